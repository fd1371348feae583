"""The register layouts and conversion asm of the int4 register-operand decode
(``decode_int4_regs_kernel``): how a tile's packed nibbles, and their scales and zeros, are
loaded so that after the conversion they are the warp-group MMAs' A operands without moving.
Host-side values, built once per shape (cached) and passed to the kernel as constexprs. Owns
nothing.

The MMAs are the 8-bit Gluon decode's (``decode_8bit_gluon_layouts.operand_layouts``: k_width
2, a thread's share of an operand row is the hardware k = 16 ks + 8 b3 + 2 c + b0 for its lane's
c and every ks, b3, b0; the k index is relabelled freely since both operands follow it).

* K (logits, ``s^T = K . q^T``): a thread's share of a row is D/4 channels, D/8 contiguous bytes
  of the token-major pool page. A 32-bit word holds channels 8w..8w+7 (byte i: channel 2i in
  the low nibble, 2i + 1 in the high one); its conversion (``K_WORD_ASM``) yields the pairs
  (0, 2), (1, 3), (4, 6), (5, 7): the pool's K scales are stored even channels first, so each
  pair's scale and zero are one aligned 32-bit word there. Hardware k then holds physical
  channel ``c D/4 + 4 ks + b3 + 2 b0`` (the query is loaded in that order).
* V^T (P.V, ``o^T = V^T . p^T``): token-minor int4 pages (``v_layout`` "HDN": a byte holds two
  tokens of a channel, the even one in the low nibble) give a thread 16 contiguous tokens of a
  channel in 8 bytes; a word's conversion (``V_WORD_ASM``) yields the token pairs (0, 1) ..
  (6, 7), whose per-token scales and zeros are aligned 32-bit words of the token-minor scale
  rows. The tile's tokens follow the 8-bit kernel's numbering: hardware k (and logits row m) is
  token ``16 c + 4 ks + 2 b3 + b0``. V^T's rows (the output channels) are relabelled too: the
  thread of lane row l in warp w holds D/32 consecutive channels, ``(8 w + l) D/32 + 2 i + h``
  for its rows ``64 i + 16 w + 8 h + l``, all in one 32-channel scale group, so one scale row
  serves all of them (the epilogue maps the rows back: ``_split_out``'s CHMAP 2).
"""
from __future__ import annotations

import functools

_HEAD = ("{\n.reg .b32 a, b, t, c, m, n, k, o;\n"
         "mov.b32 c, 0x64006400;\nmov.b32 m, 0x000f000f;\nmov.b32 n, 0x00f000f0;\n"
         "mov.b32 k, 0x2c002c00;\nmov.b32 o, 0xd400d400;\n")

# one 32-bit word of eight K codes ($8; channels 8w..8w+7) -> eight float16 values, code * scale
# + zero with one float16 rounding (as the reference's): $0..$7 the pairs (0, 2), (1, 3), (4, 6),
# (5, 7), each pair from one register; $9..$12 their scales (even a, odd a, even b, odd b: words
# of the even-first scale rows), $13..$16 their zeros. prmt spreads two bytes into a register's
# halves (a: bytes 0-1, b: 2-3), lop3 puts a nibble under the float16 exponent of 1024 (low:
# 1024 + c, high: 1024 + 16 c), sub / fma (times 1/16, minus 64) remove it exactly
K_WORD_ASM = (
    _HEAD + "prmt.b32 a, $8, 0, 0x4140;\nprmt.b32 b, $8, 0, 0x4342;\n"
    + "".join(
        f"lop3.b32 t, {r}, {mask}, c, 0xea;\n" + fix
        + f"fma.rn.f16x2 t, t, ${9 + 2 * j + hi}, ${13 + 2 * j + hi};\n"
        + f"mov.b32 {{${4 * j + 2 * hi}, ${4 * j + 2 * hi + 1}}}, t;\n"
        for j, r in enumerate("ab") for hi, (mask, fix) in enumerate(
            [("m", "sub.f16x2 t, t, c;\n"), ("n", "fma.rn.f16x2 t, t, k, o;\n")]))
    + "}\n")

# one 32-bit word of eight V codes ($8; tokens 0..7 of a channel, byte i: token 2i low, 2i + 1
# high) -> $0..$7 the tokens in order, code * scale + zero: prmt puts byte i of the word in the
# low half and byte i of the word shifted right by 4 in the high half, lop3 their low nibbles
# under the float16 exponent of 1024 (1024 + c), sub removes it exactly, fma applies $9 + i /
# $13 + i, the scale and zero of the tokens (2i, 2i + 1)
V_WORD_ASM = (
    "{\n.reg .b32 t, s, c, m;\n"
    "mov.b32 c, 0x64006400;\nmov.b32 m, 0x000f000f;\nshr.b32 s, $8, 4;\n"
    + "".join(
        f"prmt.b32 t, $8, s, 0x{0x0400 + 0x101 * i:04x};\n"
        "lop3.b32 t, t, m, c, 0xea;\nsub.f16x2 t, t, c;\n"
        f"fma.rn.f16x2 t, t, ${9 + i}, ${13 + i};\nmov.b32 {{${2 * i}, ${2 * i + 1}}}, t;\n"
        for i in range(4))
    + "}\n")


def _bits(n: int) -> int:
    return n.bit_length() - 1


@functools.lru_cache(maxsize=None)
def layouts(head_dim: int, block_h: int):
    """(MMA, LK, LK4, LKS, LV4, LVS, LAK, LAV) for heads of ``head_dim`` and ``block_h`` MMA
    columns (tiles of 64 tokens, pages of 32):

    * LK ``[64 rows, D/8 words]``: K's codes as loaded (D/32 words of a row a thread, rows r
      and r + 8); LK4 the same as ``[4, 2, 8, D/8]`` (the row split as 16 w + 8 h + l);
    * LKS ``[4, 8, D/4]``: K's scale (or zero) words of a thread's page, ``2 w + (a, b)`` for
      code word w and register pair (a, b), without the row + 8 (both rows share a page);
    * LV4 ``[32, D/32, 2, 4]``: V's code words, (thread row, its channel, page, word);
    * LVS ``[32, 2, 4, 4]``: V's scale (or zero) words of the thread's 16 tokens' group;
    * LAK, LAV: the MMAs' A-operand layouts."""
    from triton.experimental.gluon import language as gl

    d = head_dim
    w_bits = _bits(d // 32)  # a thread's K words per row: D/32
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 16])
    lk = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(w_bits)] + [[8, 0]],
        lane_bases=[[0, d // 32], [0, d // 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, d // 8])
    lk4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(w_bits)] + [[0, 1, 0, 0]],
        lane_bases=[[0, 0, 0, d // 32], [0, 0, 0, d // 16], [0, 0, 1, 0], [0, 0, 2, 0],
                    [0, 0, 4, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 2, 8, d // 8])
    lks = gl.DistributedLinearLayout(  # [4, 8, D/4 words]: word 2 w + (a, b), contiguous
        reg_bases=[[0, 0, 1 << i] for i in range(w_bits + 1)],
        lane_bases=[[0, 0, d // 16], [0, 0, d // 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 8, d // 4])
    lv4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1]] + [[0, 1 << i, 0, 0] for i in range(w_bits)],
        lane_bases=[[0, 0, 0, 2], [0, 0, 1, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, d // 32, 2, 4])
    lvs = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0]],
        lane_bases=[[0, 0, 2, 0], [0, 1, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, 2, 4, 4])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    return mma, lk, lk4, lks, lv4, lvs, a, a
