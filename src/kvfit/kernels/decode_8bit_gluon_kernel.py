"""The 8-bit (fp8_e4m3, fp8_e5m2, int8) paged decode written in Gluon for Hopper: warp-group
MMAs whose A operands (K for the logits, V^T for P.V) come straight from registers, loaded
from global memory in a layout that becomes the MMA's operand layout after the conversion.

Why. The Triton decode converts 8-bit tiles into ``mma.sync`` operand layouts. For fp8 on
128-d heads that reads at the copy bandwidth, but int8 (1.12x fp8's time on Qwen3 heads) and
64-d heads (fp8 2.8-3.4 TB/s, int8 2.5-3.0) stay short of it (docs/benchmarks.md, "8-bit
decode"). A first Gluon version converted each tile into float16 shared-memory tiles, as the
int4 kernel (``decode_int4_gluon``) does: 1.4-1.9x the Triton kernels' time on the H200, bound
by its per-tile chain of shared-memory stores, fences and barriers (docs/benchmarks.md). Here a
tile's path is registers only, but for P:

    K, V codes --16-byte loads of 32-bit words, a tile ahead--> registers
    words --cvt (e4m3), prmt (e5m2), xor/prmt/sub (int8)--> float16, relabelled (no moves)
    s^T [64, H] = K . q^T              (A = K from registers; q in shared memory all along)
    int8: s^T rows times their token's K scale; p^T rows times their V scale before P.V
    o^T [D, H] += V^T . p^T            (A = V^T from registers; p^T in shared memory)

The relabelling (``operand_layouts``): the MMA's k index is a reduction index, so any
permutation of it applied to both operands gives the same products. K's channels are loaded in
the order that makes each thread's share of a row contiguous (the query is loaded in the same
order), and the tile's tokens are numbered so that each thread's share of V's rows is 16
contiguous tokens (K's rows, P's rows and the masks follow that numbering).

A tile is 64 tokens (64 / P pages; pages of 16, 32 or 64); the loop runs the split's full
tiles without masks, and its last, partial tile once more with them (its dead tokens: logits
-inf, V zeroed, since unwritten fp8 codes may be NaN). Heads are the MMAs' N (the query group,
padded to ``BLOCK_H`` >= 8). The fp8 per-tensor K scale is folded into the query's softmax
scale, the V scale applied to the output (``v_out``; the merge applies it to a split launch).
int8 pages carry float16 scales per (page, KV head, token).

Grid ``(batch, kv heads, splits)``; one split writes ``OUT``, several write float32 partials
``OP`` (rows ``(b * Hq + head) * splits + s``) and base-2 log-sum-exp ``LSE`` for
``decode_kernels``' merge; the context is cut into splits as the Triton kernels cut it
(``decode_common._split_span``: whole 64-token tiles), an empty split exits at once and the
merge counts the live ones. No window, soft-cap or q bias (the Triton kernel serves those).
Owns nothing.
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
    """(MMA, K's load layout, V's load layout, K's and V's A-operand layouts) of the kernel.

    The logits' and P.V's A operands come straight from registers, loaded from global memory
    as 32-bit words of four codes in a layout that becomes the warp-group MMA's A-operand
    layout (``DotOperandLayout``, k_width 2) after the conversion, up to a relabelling of its
    K index, so that each thread's share of a row is contiguous in memory (16-byte loads) and
    the relabelling costs nothing (join/reshape/permute, checked trivial at compile time):
    for K's channels, hardware k = 16 ks + 8 b3 + 2 c + b0 holds physical channel
    c D/4 + 4 ks + 2 b3 + b0 (the query is loaded in the same order); for P.V's tokens the
    same with 64 tokens, so tile row m (of the logits, of P, and P.V's k) is token
    16 c + 4 ks + 2 b3 + b0 of the tile. K's words ``[64 rows, D / 4]``; V's ``[D, pages,
    P / 4]``, the page index its own axis (one gathered page id per 16 contiguous tokens)."""
    from triton.experimental.gluon import language as gl

    d = head_dim
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 16])
    lane_rows, warp_rows = [[1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]]
    lk = gl.DistributedLinearLayout(  # D / 16 words of a row a thread, then row + 8
        reg_bases=[[0, 1 << i] for i in range(_bits(d // 16))] + [[8, 0]],
        lane_bases=[[0, d // 16], [0, d // 8]] + lane_rows, warp_bases=warp_rows,
        block_bases=[], shape=[64, d // 4])
    wpp = page // 4  # words a page row

    def split(b):  # [d, word] -> [d, word // wpp, word % wpp]
        return [b[0], b[1] // wpp, b[1] % wpp]

    lv = gl.DistributedLinearLayout(  # 4 words (16 tokens) of a channel a thread
        reg_bases=[split(b) for b in [[0, 1], [0, 2], [8, 0]]
                   + [[64 << i, 0] for i in range(_bits(d // 64))]],
        lane_bases=[split(b) for b in [[0, 4], [0, 8]] + lane_rows],
        warp_bases=[split(b) for b in warp_rows], block_bases=[], shape=[d, 64 // page, wpp])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    return mma, lk, lv, a, a


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names())
    globals().update({f"_ASM_{n}": gl.constexpr(WORD_TO_F16_ASM[k])  # noqa: F821
                      for n, k in (("E4M3", "fp8_e4m3"), ("E5M2", "fp8_e5m2"), ("I8", "int8"))})

    @gluon.jit
    def _words_to_f16(x, CODE: gl.constexpr):
        # 32-bit words of four codes [..., W] -> float16 [..., W, 2, 2] ([.., t, i]: byte 2t + i)
        if CODE == 0:
            asm: gl.constexpr = _ASM_E4M3  # noqa: F821
        elif CODE == 1:
            asm: gl.constexpr = _ASM_E5M2  # noqa: F821
        else:
            asm: gl.constexpr = _ASM_I8  # noqa: F821
        b0, b1, b2, b3 = gl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r", [x],
                                                   dtype=(gl.float16,) * 4, is_pure=True,
                                                   pack=1)
        return gl.join(gl.join(b0, b2), gl.join(b1, b3))

    @gluon.jit
    def _token(m):
        # the tile's token at row m (of the logits, of P, and P.V's k): 16 c + 4 ks + 2 b3 + b0
        # for m = 16 ks + 8 b3 + 2 c + b0
        return ((m >> 1) & 3) * 16 + (m >> 4) * 4 + ((m >> 3) & 1) * 2 + (m & 1)

    @gluon.jit
    def _hw_k(x, R: gl.constexpr, C: gl.constexpr, LA: gl.constexpr):
        # x [R, C] with physical column order -> the MMA's k order (a relabelling, no data
        # moves): column 4 ks + 2 b3 + b0 + (C / 4) c becomes k = 16 ks + 8 b3 + 2 c + b0
        y = gl.reshape(x, [R, 4, C // 16, 2, 2])
        y = gl.reshape(gl.permute(y, (0, 2, 3, 1, 4)), [R, C])
        return gl.convert_layout(y, LA, assert_trivial=True)

    @gluon.jit
    def _load(KCh, VCh, bt_row, t0, n1, stride_cp, D: gl.constexpr, PAGE: gl.constexpr,
              NPG: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr):
        # the tile's codes from token t0 as 32-bit words (rows and pages from n1 on not
        # loaded: whatever the registers held, masked in the logits, and zeroed in V with a
        # partial tile's dead tokens): K [64 rows (tokens by _token), D / 4], V [D, NPG,
        # PAGE / 4]
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, LK))
        tok = t0 + _token(m)
        live = tok < n1
        pg = gl.load(bt_row + tok // PAGE, mask=live, other=0).to(gl.int64)
        rows = (KCh + pg * stride_cp + (tok % PAGE) * D).to(gl.pointer_type(gl.int32),
                                                            bitcast=True)
        w = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LK))
        k = gl.load(rows[:, None] + w[None, :], mask=live[:, None])
        LV2: gl.constexpr = gl.SliceLayout(2, LV)  # [D, NPG]
        f = t0 + PAGE * gl.arange(0, NPG, layout=gl.SliceLayout(0, LV2))  # pages' first tokens
        pgv = gl.load(bt_row + f // PAGE, mask=f < n1, other=0).to(gl.int64)
        dv = gl.arange(0, D, layout=gl.SliceLayout(1, LV2))
        base = VCh + (dv * PAGE)[:, None] + (pgv * stride_cp)[None, :]  # [D, NPG]
        wv = gl.arange(0, PAGE // 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, LV)))
        ptr = (base.to(gl.pointer_type(gl.int32), bitcast=True)[:, :, None]
               + wv[None, :][None, :, :])
        v = gl.load(ptr, mask=(f < n1)[None, :][:, :, None])
        return k, v

    @gluon.jit
    def _token_scales(KS, VS, bt_row, t0, n1, s_head, stride_sp, PAGE: gl.constexpr,
                      L: gl.constexpr):
        # int8: the K and V scales of the tile's rows ([64] float32 in layout L, 0 for tokens
        # from n1 on)
        tok = t0 + _token(gl.arange(0, 64, layout=L))
        live = tok < n1
        pg = gl.load(bt_row + tok // PAGE, mask=live, other=0).to(gl.int64)
        off = pg * stride_sp + s_head + tok % PAGE
        return (gl.load(KS + off, mask=live, other=0.0).to(gl.float32),
                gl.load(VS + off, mask=live, other=0.0).to(gl.float32))

    @gluon.jit
    def _tile(k_raw, v_raw, ks, vs, qs, p_s, acc, m_i, l_t, n_live, tok_r, tok_k,
              D: gl.constexpr, BLOCK_H: gl.constexpr, CODE: gl.constexpr, MASKED: gl.constexpr,
              MMA: gl.constexpr, LAK: gl.constexpr, LAV: gl.constexpr):
        # one tile of 64 tokens (MASKED: its tokens from n_live on are dead): s^T = K . q^T
        # (the query holds the base-2 softmax scale; int8 rows times their K scale), the
        # online softmax, o^T += V^T . p^T (int8 p rows times their V scale). The running sum
        # stays per row of the tile (l_t [64, BLOCK_H]), summed once at the end
        kt = _hw_k(gl.reshape(_words_to_f16(k_raw, CODE), [64, D]), 64, D, LAK)
        zero = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        s_t = warpgroup_mma(kt, qs.permute((1, 0)), zero, use_acc=False,  # noqa: F821
                            is_async=True)
        # V converted while the logits' MMAs run; a partial tile's unwritten tokens (any
        # bits, NaN fp8 codes included: 0 * NaN would reach the output) zeroed
        vt = _hw_k(gl.reshape(_words_to_f16(v_raw, CODE), [D, 64]), D, 64, LAV)
        if MASKED:
            vt = gl.where((tok_k < n_live)[None, :], vt, 0.0)
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))  # noqa: F821
        if CODE == 2:
            s_t = s_t * ks[:, None]
        if MASKED:
            s_t = gl.where((tok_r < n_live)[:, None], s_t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p_t = gl.exp2(s_t - m_use[None, :])
        l_t = l_t * alpha[None, :] + p_t
        if CODE == 2:
            p_t = p_t * vs[:, None]
        _cta_barrier()  # noqa: F821 -- the last tile's P.V has read p_s everywhere
        p_s.store(p_t.to(gl.float16))
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821
        acc = warpgroup_mma(vt, p_s, acc * alpha[None, :], is_async=True)  # noqa: F821
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # noqa: F821
        return acc, m_new, l_t

    @gluon.jit
    def _decode_8bit_gluon(Q, OUT, OP, LSE, KC, VC, KS, VS, BT, KVLEN,
                           stride_qb, stride_qh, stride_ob, stride_oh, stride_cp, stride_ch,
                           stride_sp, stride_sh, stride_bt, qk_scale, v_out, num_splits,
                           G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,
                           PAGE: gl.constexpr, CODE: gl.constexpr, SINGLE: gl.constexpr,
                           MMA: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
                           LAK: gl.constexpr, LAV: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(64 % PAGE == 0, "pages of 16, 32 or 64 tokens")
        INT8: gl.constexpr = CODE == 2
        b = gl.program_id(0)
        h = gl.program_id(1)
        s = gl.program_id(2)
        NPG: gl.constexpr = 64 // PAGE  # a tile: 64 tokens, the logits MMAs' M
        # the query [BLOCK_H, D] (float32), SPQ values a thread
        SPQ: gl.constexpr = 8 if BLOCK_H * D >= 1024 else BLOCK_H * D // 128
        TPC: gl.constexpr = 32 if D // SPQ >= 32 else D // SPQ
        LQ: gl.constexpr = gl.BlockedLayout([1, SPQ], [32 // TPC, TPC], [4, 1], [1, 0])
        LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        qs = gl.allocate_shared_memory(
            gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D],
                                                                           gl.float16))
        p_s = gl.allocate_shared_memory(
            gl.float16, [64, BLOCK_H], gl.NVMMASharedLayout.get_default_for([64, BLOCK_H],
                                                                            gl.float16))

        # the query group [BLOCK_H, D] times the base-2 softmax scale, its channels in the
        # MMA's k order (_hw_k: column k holds channel (D/4) c + 4 ks + 2 b3 + b0), in shared
        # memory for the whole program (the first tile's fence and barrier publish it)
        hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        chq = ((kq >> 1) & 3) * (D // 4) + (kq >> 4) * 4 + ((kq >> 3) & 1) * 2 + (kq & 1)
        qptr = Q + b.to(gl.int64) * stride_qb + (h * G + hq)[:, None] * stride_qh + chq[None, :]
        q = gl.load(qptr, mask=(hq < G)[:, None], other=0.0).to(gl.float32) * qk_scale
        qs.store(q.to(gl.float16))
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821

        # split s: tokens [n0, n1), whole tiles, as decode_common._split_span cuts them
        kv_len = gl.load(KVLEN + b)
        per = gl.cdiv(gl.cdiv(kv_len, num_splits), 64) * 64
        n0 = s * per
        n1 = gl.minimum(n0 + per, kv_len)
        if not SINGLE:
            if n1 <= n0:  # an empty split writes nothing: the merge counts the live ones
                return
        bt_row = BT + b.to(gl.int64) * stride_bt
        KCh = KC + h * stride_ch
        VCh = VC + h * stride_ch
        s_head = h * stride_sh
        LR: gl.constexpr = gl.SliceLayout(1, MMA)
        r = gl.arange(0, 64, layout=LR)
        tok_r = _token(r)  # the logits rows' tokens in a tile
        kk = gl.arange(0, 64, layout=gl.SliceLayout(0, LAV))
        tok_k = _token(kk)  # P.V's k's tokens in a tile

        k_raw, v_raw = _load(KCh, VCh, bt_row, n0, n1, stride_cp, D, PAGE, NPG, LK, LV)
        ks = qk_scale  # int8: the tile's token scales
        vs = qk_scale
        if INT8:
            ks, vs = _token_scales(KS, VS, bt_row, n0, n1, s_head, stride_sp, PAGE, LR)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_t = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        acc = gl.zeros([D, BLOCK_H], gl.float32, layout=MMA)
        n_full = gl.maximum(n1 - n0, 0) // 64
        for i in range(n_full):
            k_cur = k_raw
            v_cur = v_raw
            ks_c = ks
            vs_c = vs
            # the next tile's codes (and scales) into registers while this one is computed
            t1 = n0 + 64 * (i + 1)
            k_raw, v_raw = _load(KCh, VCh, bt_row, t1, n1, stride_cp, D, PAGE, NPG, LK, LV)
            if INT8:
                ks, vs = _token_scales(KS, VS, bt_row, t1, n1, s_head, stride_sp, PAGE, LR)
            acc, m_i, l_t = _tile(k_cur, v_cur, ks_c, vs_c, qs, p_s, acc, m_i, l_t,
                                  64, tok_r, tok_k, D, BLOCK_H, CODE, False, MMA, LAK, LAV)
        n_live = gl.maximum(n1 - n0, 0) - 64 * n_full
        if n_live > 0:  # the split's last, partial tile (loaded by the last iteration)
            acc, m_i, l_t = _tile(k_raw, v_raw, ks, vs, qs, p_s, acc, m_i,
                                  l_t, n_live, tok_r, tok_k, D, BLOCK_H, CODE, True, MMA, LAK,
                                  LAV)

        # o^T = acc [D, BLOCK_H] / l
        l_i = gl.sum(l_t, axis=0)
        safe_l = gl.where(l_i > 0, l_i, 1.0)
        o_t = gl.convert_layout(acc / safe_l[None, :], LO)
        d = gl.arange(0, D, layout=gl.SliceLayout(1, LO))
        g = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LO))
        omask = (g < G)[None, :] & (d < D)[:, None]
        if SINGLE:
            dst = OUT + b.to(gl.int64) * stride_ob + (h * G + g)[None, :] * stride_oh
            gl.store(dst + d[:, None], (o_t * v_out).to(OUT.dtype.element_ty), mask=omask)
        else:
            hkv = gl.num_programs(1)
            orow = (b.to(gl.int64) * (hkv * G) + h * G + g) * num_splits + s  # [BLOCK_H]
            gl.store(OP + orow[None, :] * D + d[:, None], o_t, mask=omask)
            lse = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
            gh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))
            lrow = (b.to(gl.int64) * (hkv * G) + h * G + gh) * num_splits + s
            gl.store(LSE + lrow, lse, mask=gh < G)

    return _decode_8bit_gluon
