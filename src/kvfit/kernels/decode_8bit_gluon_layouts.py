"""The register layouts of the Gluon 8-bit decode (``decode_8bit_gluon_kernel``): how a tile's
codes are loaded so that, after their conversion, they are the warp-group MMAs' A operands
without moving (``operand_layouts``; ``int8_key_layouts`` for int8 keys on s8 MMAs), and the
asm that converts a 32-bit word of four codes to float16 (``WORD_TO_F16_ASM``). Host-side
values, built once per shape (cached); they are passed to the kernel as constexprs. Owns
nothing.
"""
from __future__ import annotations

import functools

# a 32-bit word of four 8-bit codes -> four float16 values ($0..$3, bytes 0..3), exactly:
# fp8_e4m3 by two packed cvt; fp8_e5m2 by placing each byte as a float16's high byte (prmt);
# int8 by biasing each byte by 128 (xor), putting it under the float16 exponent of 1024 (prmt:
# 0x64XX = 1024 + XX exactly) and subtracting 1152 = 1024 + 128 (no I2F, a quarter-rate unit)
WORD_TO_F16_ASM = {
    "fp8_e4m3": ("{\n.reg .b16 l, h;\n.reg .b32 a, b;\nmov.b32 {l, h}, $4;\n"
                 "cvt.rn.f16x2.e4m3x2 a, l;\ncvt.rn.f16x2.e4m3x2 b, h;\n"
                 "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}\n"),
    "fp8_e5m2": ("{\n.reg .b32 a, b;\nprmt.b32 a, $4, 0, 0x1404;\nprmt.b32 b, $4, 0, 0x3424;\n"
                 "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}\n"),
    "int8": ("{\n.reg .b32 a, lo, hi, c;\nxor.b32 a, $4, 0x80808080;\n"
             "prmt.b32 lo, a, 0x64646464, 0x4140;\nprmt.b32 hi, a, 0x64646464, 0x4342;\n"
             "mov.b32 c, 0x64806480;\nsub.f16x2 lo, lo, c;\nsub.f16x2 hi, hi, c;\n"
             "mov.b32 {$0, $1}, lo;\nmov.b32 {$2, $3}, hi;\n}\n"),
}


def _bits(n: int) -> int:
    return n.bit_length() - 1


@functools.lru_cache(maxsize=None)
def operand_layouts(head_dim: int, page: int, block_h: int):
    """(MMA, K's load layout, V's load layout, K's and V's A-operand layouts) of the kernel
    (tiles of T = 64 tokens).

    The logits' and P.V's A operands come straight from registers, loaded from global memory
    as 32-bit words of four codes in a layout that becomes the warp-group MMA's A-operand
    layout (``DotOperandLayout``, k_width 2) after the conversion, up to a relabelling of its
    K index, so that each thread's share of a row is contiguous in memory (16-byte loads) and
    the relabelling costs nothing (join/reshape/permute, checked trivial at compile time):
    for K's channels, hardware k = 16 ks + 8 b3 + 2 c + b0 holds physical channel
    c D/4 + 4 ks + 2 b3 + b0 (the query is loaded in the same order); for P.V's tokens the
    same over the tile's tokens, so tile row m (of the logits, of P, and P.V's k) is token
    c T/4 + 4 ks + 2 b3 + b0 of the tile. K's words ``[T rows, D / 4]``; V's ``[D, pages,
    P / 4]``, the page index its own axis (one gathered page id per 16 contiguous tokens)."""
    from triton.experimental.gluon import language as gl

    d, tok = head_dim, 64
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 16])
    lane_rows, warp_rows = [[1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]]

    def rows(n):  # the row bases of n rows held by one warp group: row + 8, then + 64 ...
        return [[8, 0]] + [[64 << i, 0] for i in range(_bits(n // 64))]

    lk = gl.DistributedLinearLayout(  # D / 16 words of a row a thread, then row + 8 (+ 64)
        reg_bases=[[0, 1 << i] for i in range(_bits(d // 16))] + rows(tok),
        lane_bases=[[0, d // 16], [0, d // 8]] + lane_rows, warp_bases=warp_rows,
        block_bases=[], shape=[tok, d // 4])
    wpp = page // 4  # words a page row

    def split(b):  # [d, word] -> [d, word // wpp, word % wpp]
        return [b[0], b[1] // wpp, b[1] % wpp]

    lv = gl.DistributedLinearLayout(  # T / 16 words (T / 4 tokens) of a channel a thread
        reg_bases=[split(b) for b in [[0, 1 << i] for i in range(_bits(tok // 16))]
                   + rows(d)],
        lane_bases=[split(b) for b in [[0, tok // 16], [0, tok // 8]] + lane_rows],
        warp_bases=[split(b) for b in warp_rows], block_bases=[],
        shape=[d, tok // page, wpp])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    return mma, lk, lv, a, a


@functools.lru_cache(maxsize=None)
def int8_key_layouts(head_dim: int, block_h: int):
    """(integer MMA, K's load layout, K's A-operand layout) of int8 keys, whose logits run on
    s8 warp-group MMAs (k_width 4, 32-channel steps) against the query split into two int8
    terms: K's codes are the A operand as loaded, no conversion. The relabelling as in
    ``operand_layouts``, over bytes: hardware k = 16 w + 4 c + j (w = 2 ks + b4, j a byte of a
    32-bit register) holds physical channel c D/4 + 4 w + j, so a thread's share of a row is
    D/4 contiguous bytes. K's load layout is over ``[T rows, D / 4 words, 4 bytes]``: its
    slice along the bytes loads the words, which are then broadcast along them."""
    from triton.experimental.gluon import language as gl

    d, tok = head_dim, 64
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 32])
    lk = gl.DistributedLinearLayout(  # 4 bytes of D / 16 words a thread, then row + 8 (+ 64)
        reg_bases=[[0, 0, 1], [0, 0, 2]] + [[0, 1 << i, 0] for i in range(_bits(d // 16))]
        + [[8, 0, 0]] + [[64 << i, 0, 0] for i in range(_bits(tok // 64))],
        lane_bases=[[0, d // 16, 0], [0, d // 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[tok, d // 4, 4])
    return mma, lk, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
