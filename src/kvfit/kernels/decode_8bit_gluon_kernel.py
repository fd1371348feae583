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
    words --cvt (e4m3), prmt (e5m2), xor/prmt/sub (int8 V)--> float16, relabelled (no moves)
    s^T [T, H] = K . q^T               (A = K from registers; q in shared memory all along)
    int8: K's words are the operand as loaded, on s8 MMAs against the query's two int8 terms
          (exact int32 sums); s^T rows times their token's K scale, p^T rows times their V
          scale before P.V
    o^T [D, H] += V^T . p^T            (A = V^T from registers; p^T in shared memory)

The relabelling (``decode_8bit_gluon_layouts``): the MMA's k index is a reduction index, so any
permutation of it applied to both operands gives the same products. K's channels are loaded in
the order that makes each thread's share of a row contiguous (the query is loaded in the same
order), and the tile's tokens are numbered so that each thread's share of V's rows is 16
contiguous tokens (K's rows, P's rows and the masks follow that numbering).

A tile is T = 64 tokens (T / P pages; pages of 16, 32 or 64); the loop runs the split's full
tiles without masks, and its last, partial tile once more with them (its dead tokens: logits
-inf, V zeroed, since unwritten fp8 codes may be NaN). Heads are the MMAs' N (the query group,
padded to ``BLOCK_H`` >= 8). The fp8 per-tensor K scale is folded into the query's softmax
scale, the V scale applied to the output (``v_out``; the merge applies it to a split launch).
int8 pages carry float16 scales per (page, KV head, token).

Grid ``(batch, kv heads, splits)``; one split writes ``OUT``, several write float32 partials
``OP`` (rows ``(b * Hq + head) * splits + s``) and base-2 log-sum-exp ``LSE`` for
``decode_kernels``' merge; the context is cut into splits as the Triton kernels cut it
(``decode_common._split_span``: whole tiles), an empty split exits at once and the
merge counts the live ones. No window, soft-cap or q bias (the Triton kernel serves those).
``L2_AHEAD`` > 0: tile i also asks L2 for tile i + L2_AHEAD's lines (``_l2_ask``; nothing
waits for it). Owns nothing.
"""
from __future__ import annotations

import functools

from kvfit.kernels.decode_8bit_gluon_layouts import WORD_TO_F16_ASM


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names, mha_decode_parts

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names(), **mha_decode_parts())
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
    def _hw_k8(x, R: gl.constexpr, C: gl.constexpr, LK: gl.constexpr, LA: gl.constexpr):
        # 32-bit words x [R, C / 4] of int8 codes in physical column order -> int8 [R, C] in
        # the s8 MMA's k order (no data moves): the words as bytes (a broadcast to four
        # copies, and one asm per word naming its four bytes), then column 4 w + j + (C / 4) c
        # becomes k = 16 w + 4 c + j
        w4, _ = gl.broadcast(gl.expand_dims(x, 2), gl.zeros([R, C // 4, 4], gl.int32, LK))
        w4 = gl.reshape(w4, [R, C])
        y = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w4], dtype=gl.int8,
                                      is_pure=True, pack=4)
        y = gl.reshape(gl.permute(gl.reshape(y, [R, 4, C // 16, 4]), (0, 2, 1, 3)), [R, C])
        return gl.convert_layout(y, LA, assert_trivial=True)

    @gluon.jit
    def _load(KCh, VCh, KS, VS, bt_row, t0, n1, stride_cp, s_head, stride_sp, q_f,
              D: gl.constexpr, PAGE: gl.constexpr, TOK: gl.constexpr, INT8: gl.constexpr,
              LK: gl.constexpr, LV: gl.constexpr, LR: gl.constexpr):
        # the tile's codes from token t0 (rows and pages from n1 on not loaded: whatever the
        # registers held, masked in the logits, and zeroed in V with a partial tile's dead
        # tokens) as 32-bit words: K [TOK rows (tokens by _tile_token), D / 4] (INT8: in the
        # slice of int8_key_layouts' 3-D layout), V [D, TOK / PAGE, PAGE / 4]; int8: the
        # rows' K scales times the query's factor q_f and their V scales ([TOK] float32 in
        # the logits' row layout LR, 0 from n1 on), through the K rows' page ids (q_f twice
        # otherwise). t0 is a multiple of the page size (splits and tiles are whole 64-token
        # tiles): a row's page is t0 / P plus its tile token's, its slot the tile token's
        NPG: gl.constexpr = TOK // PAGE
        SHIFT: gl.constexpr = 4 if PAGE == 16 else (5 if PAGE == 32 else 6)  # log2(P)
        p0 = t0 >> SHIFT
        if INT8:
            LKW: gl.constexpr = gl.SliceLayout(2, LK)
        else:
            LKW: gl.constexpr = LK
        m = gl.arange(0, TOK, layout=gl.SliceLayout(1, LKW))
        tl = _tile_token(m, TOK)  # noqa: F821 -- the rows' tokens in the tile
        live = t0 + tl < n1
        slot = tl & (PAGE - 1)
        pg32 = gl.load(bt_row + (p0 + (tl >> SHIFT)), mask=live, other=0)
        rows = (KCh + pg32.to(gl.int64) * stride_cp + slot * D).to(gl.pointer_type(gl.int32),
                                                                   bitcast=True)
        w = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LKW))
        k = gl.load(rows[:, None] + w[None, :], mask=live[:, None])
        LV2: gl.constexpr = gl.SliceLayout(2, LV)  # [D, NPG]
        j = gl.arange(0, NPG, layout=gl.SliceLayout(0, LV2))  # the tile's pages
        f = t0 + PAGE * j  # their first tokens
        pgv = gl.load(bt_row + (p0 + j), mask=f < n1, other=0).to(gl.int64)
        dv = gl.arange(0, D, layout=gl.SliceLayout(1, LV2))
        base = VCh + (dv * PAGE)[:, None] + (pgv * stride_cp)[None, :]  # [D, NPG]
        wv = gl.arange(0, PAGE // 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, LV)))
        ptr = (base.to(gl.pointer_type(gl.int32), bitcast=True)[:, :, None]
               + wv[None, :][None, :, :])
        v = gl.load(ptr, mask=(f < n1)[None, :][:, :, None])
        ks = q_f
        vs = q_f
        if INT8:  # the K rows' threads hold the logits rows: the layout change moves nothing
            off = pg32 * stride_sp + s_head + slot  # < 2^31: launch_args checks
            ks = gl.convert_layout(gl.load(KS + off, mask=live, other=0.0).to(gl.float32) * q_f,
                                   LR, assert_trivial=True)
            vs = gl.convert_layout(gl.load(VS + off, mask=live, other=0.0).to(gl.float32), LR,
                                   assert_trivial=True)
        return k, v, ks, vs

    @gluon.jit
    def _l2_ask(KCh, VCh, KS, VS, bt_row, t0, n1, stride_cp, s_head, stride_sp,
                D: gl.constexpr, PAGE: gl.constexpr, INT8: gl.constexpr):
        # ask L2 for the tile of tokens [t0, t0 + 64) (pages from n1 on: the split's last page
        # again), fire and forget: no register waits for it, so the tile's loads, tiles later,
        # find their lines in L2, not DRAM. Its D lines of codes (K's pages, then V's, PAGE x D
        # bytes a page each) over 128 threads ([128, R], R = D / 128 or 1: at 64-d two threads
        # a line); int8: each thread also asks for the line of its page's K (V) scales
        R: gl.constexpr = D // 128 if D >= 128 else 1
        PL: gl.constexpr = PAGE * D // 128  # lines a page
        SHIFT: gl.constexpr = 4 if PAGE == 16 else (5 if PAGE == 32 else 6)  # log2(P)
        LP: gl.constexpr = gl.BlockedLayout([1, R], [32, 1], [4, 1], [1, 0])
        e = gl.arange(0, 128, layout=gl.SliceLayout(1, LP))
        r = gl.arange(0, R, layout=gl.SliceLayout(0, LP))
        ln = (e[:, None] * R + r[None, :]) % D  # [128, R]
        m = ln % (D // 2)  # the line in K's (ln < D / 2) or V's pages
        pg = gl.load(bt_row + gl.minimum((t0 >> SHIFT) + m // PL, (n1 - 1) >> SHIFT))
        is_k = ln < D // 2
        code = gl.where(is_k, KCh.to(gl.int64), VCh.to(gl.int64)) + (m % PL) * 128
        _l2_prefetch(code + pg.to(gl.int64) * stride_cp)  # noqa: F821
        if INT8:
            off = pg * stride_sp + s_head  # < 2^31: launch_args checks
            _l2_prefetch(gl.where(is_k, (KS + off).to(gl.int64),  # noqa: F821
                                  (VS + off).to(gl.int64)))

    @gluon.jit
    def _tile(k_raw, v_raw, ks, vs, qs, q_lo, p_s, mx_s, acc, m_i, l_t, n_live, tok_r, tok_k,
              D: gl.constexpr, BLOCK_H: gl.constexpr, TOK: gl.constexpr, CODE: gl.constexpr,
              MASKED: gl.constexpr, MMA: gl.constexpr, MMA_I: gl.constexpr, LK: gl.constexpr,
              LAK: gl.constexpr, LAV: gl.constexpr, XMAX: gl.constexpr):
        # one tile of TOK tokens (MASKED: its tokens from n_live on are dead): s^T = K . q^T
        # (the query holds the base-2 softmax scale), the online softmax, o^T += V^T . p^T.
        # int8: K's codes as loaded against the query's two int8 terms (qs, q_lo: exact int32
        # sums), rows times their K scale (and the query's factor: ks); p rows times their V
        # scale. The running sum stays per row of the tile (l_t [TOK, BLOCK_H]), summed once
        # at the end. XMAX: the tile's maximum through mx_s with one barrier (_tile_max), which
        # also orders the last tile's P.V before this tile's store of p_s
        if CODE == 2:
            kt = _hw_k8(k_raw, TOK, D, LK, LAK)
            zi = gl.zeros([TOK, BLOCK_H], gl.int32, layout=MMA_I)
            s_hi = warpgroup_mma(kt, qs.permute((1, 0)), zi, use_acc=False,  # noqa: F821
                                 is_async=True)
            s_lo = warpgroup_mma(kt, q_lo.permute((1, 0)), zi, use_acc=False,  # noqa: F821
                                 is_async=True)
        else:
            kt = _hw_k(gl.reshape(_words_to_f16(k_raw, CODE), [TOK, D]), TOK, D,  # noqa: F821
                       LAK)
            zero = gl.zeros([TOK, BLOCK_H], gl.float32, layout=MMA)
            s_t = warpgroup_mma(kt, qs.permute((1, 0)), zero, use_acc=False,  # noqa: F821
                                is_async=True)
        # V converted while the logits' MMAs run; a partial tile's unwritten tokens (any
        # bits, NaN fp8 codes included: 0 * NaN would reach the output) zeroed
        vt = _hw_k(gl.reshape(_words_to_f16(v_raw, CODE), [D, TOK]), D, TOK,  # noqa: F821
                   LAV)
        if MASKED:
            vt = gl.where((tok_k < n_live)[None, :], vt, 0.0)
        if CODE == 2:
            s_hi, s_lo = warpgroup_mma_wait(num_outstanding=0, deps=(s_hi, s_lo))  # noqa: F821
            s_t = gl.convert_layout((s_hi * 254 + s_lo).to(gl.float32), MMA, assert_trivial=True)
            s_t = s_t * ks[:, None]
        else:
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))  # noqa: F821
        if MASKED:
            s_t = gl.where((tok_r < n_live)[:, None], s_t, float("-inf"))
        m_new, alpha, p_t, l_t = _online_softmax_to(  # noqa: F821
            s_t, m_i, l_t, _tile_max(s_t, mx_s, MMA, XMAX))  # noqa: F821
        if CODE == 2:
            p_t = p_t * vs[:, None]
        return _pv_step(p_t, vt, p_s, acc, alpha, XMAX), m_new, l_t  # noqa: F821

    @gluon.jit
    def _decode_8bit_gluon(Q, OUT, OP, LSE, KC, VC, KS, VS, BT, KVLEN,
                           stride_qb, stride_qh, stride_ob, stride_oh, stride_cp, stride_ch,
                           stride_sp, stride_sh, stride_bt, qk_scale, v_out, num_splits,
                           G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,
                           PAGE: gl.constexpr, CODE: gl.constexpr, SINGLE: gl.constexpr,
                           MMA: gl.constexpr, MMA_I: gl.constexpr, LK: gl.constexpr,
                           LV: gl.constexpr, LAK: gl.constexpr, LAV: gl.constexpr,
                           XMAX: gl.constexpr, L2_AHEAD: gl.constexpr,
                           num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        TOK: gl.constexpr = 64  # a tile's tokens: the logits MMAs' M
        gl.static_assert(TOK % PAGE == 0, "pages of 16, 32 or 64 tokens")
        INT8: gl.constexpr = CODE == 2
        b = gl.program_id(0)
        h = gl.program_id(1)
        s = gl.program_id(2)
        # the query [BLOCK_H, D] (float32), SPQ values a thread
        SPQ: gl.constexpr = 8 if BLOCK_H * D >= 1024 else BLOCK_H * D // 128
        TPC: gl.constexpr = 32 if D // SPQ >= 32 else D // SPQ
        LQ: gl.constexpr = gl.BlockedLayout([1, SPQ], [32 // TPC, TPC], [4, 1], [1, 0])
        p_s = gl.allocate_shared_memory(
            gl.float16, [TOK, BLOCK_H], gl.NVMMASharedLayout.get_default_for([TOK, BLOCK_H],
                                                                             gl.float16))
        mx_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

        # the query group [BLOCK_H, D] times the base-2 softmax scale, its channels in the
        # MMA's k order (_hw_k: column k holds channel (D/4) c + 4 ks + 2 b3 + b0; _hw_k8:
        # (D/4) c + 4 w + j for k = 16 w + 4 c + j), in shared memory for the whole program
        hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        if INT8:
            chq = ((kq >> 2) & 3) * (D // 4) + (kq >> 4) * 4 + (kq & 3)
        else:
            chq = ((kq >> 1) & 3) * (D // 4) + (kq >> 4) * 4 + ((kq >> 3) & 1) * 2 + (kq & 1)
        qptr = Q + b.to(gl.int64) * stride_qb + (h * G + hq)[:, None] * stride_qh + chq[None, :]
        q = gl.load(qptr, mask=(hq < G)[:, None], other=0.0).to(gl.float32) * qk_scale
        q_f = qk_scale
        if INT8:
            # two int8 terms, q = q_f (254 hi + lo) up to max|q| / 64516, one factor for the
            # group (folded into the K scales): hi = rint(q / s), lo = rint(254 (q / s - hi)),
            # s = max|q| / 127 (1 if all zero)
            amax = gl.max(gl.max(gl.abs(q), axis=1), axis=0)
            sq = gl.where(amax > 0, amax / 127.0, 1.0)
            r_q = q / sq
            hi = gl.floor(r_q + 0.5)
            lo = gl.floor((r_q - hi) * 254.0 + 0.5)
            q_f = sq / 254.0
            QL8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.int8)
            qs = gl.allocate_shared_memory(gl.int8, [BLOCK_H, D], QL8)
            q_lo = gl.allocate_shared_memory(gl.int8, [BLOCK_H, D], QL8)
            qs.store(hi.to(gl.int8))
            q_lo.store(lo.to(gl.int8))
        else:
            qs = gl.allocate_shared_memory(
                gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D],
                                                                               gl.float16))
            qs.store(q.to(gl.float16))
            q_lo = qs
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821

        # split s: tokens [n0, n1), whole tiles, as decode_common._split_span cuts them
        kv_len = gl.load(KVLEN + b)
        per = gl.cdiv(gl.cdiv(kv_len, num_splits), TOK) * TOK
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
        r = gl.arange(0, TOK, layout=LR)
        tok_r = _tile_token(r, TOK)  # noqa: F821 -- the logits rows' tokens in a tile
        kk = gl.arange(0, TOK, layout=gl.SliceLayout(0, LAV))
        tok_k = _tile_token(kk, TOK)  # noqa: F821 -- P.V's k's tokens in a tile

        k_raw, v_raw, ks, vs = _load(KCh, VCh, KS, VS, bt_row, n0, n1, stride_cp, s_head,
                                     stride_sp, q_f, D, PAGE, TOK, INT8, LK, LV, LR)
        for ta in gl.static_range(1, L2_AHEAD):  # tile i + L2_AHEAD is asked of L2 in tile i
            _l2_ask(KCh, VCh, KS, VS, bt_row, n0 + TOK * ta, n1, stride_cp, s_head, stride_sp,
                    D, PAGE, INT8)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_t = gl.zeros([TOK, BLOCK_H], gl.float32, layout=MMA)
        acc = gl.zeros([D, BLOCK_H], gl.float32, layout=MMA)
        n_full = gl.maximum(n1 - n0, 0) // TOK
        for i in range(n_full):
            k_cur = k_raw
            v_cur = v_raw
            ks_c = ks
            vs_c = vs
            # the next tile's codes (and scales) into registers while this one is computed
            t1 = n0 + TOK * (i + 1)
            k_raw, v_raw, ks, vs = _load(KCh, VCh, KS, VS, bt_row, t1, n1, stride_cp, s_head,
                                         stride_sp, q_f, D, PAGE, TOK, INT8, LK, LV, LR)
            if L2_AHEAD > 0:
                _l2_ask(KCh, VCh, KS, VS, bt_row, n0 + TOK * (i + L2_AHEAD), n1, stride_cp,
                        s_head, stride_sp, D, PAGE, INT8)
            acc, m_i, l_t = _tile(k_cur, v_cur, ks_c, vs_c, qs, q_lo, p_s, mx_s, acc, m_i,
                                  l_t, TOK, tok_r, tok_k, D, BLOCK_H, TOK, CODE, False, MMA,
                                  MMA_I, LK, LAK, LAV, XMAX)
        n_live = gl.maximum(n1 - n0, 0) - TOK * n_full
        if n_live > 0:  # the split's last, partial tile (loaded by the last iteration)
            acc, m_i, l_t = _tile(k_raw, v_raw, ks, vs, qs, q_lo, p_s, mx_s, acc, m_i, l_t,
                                  n_live, tok_r, tok_k, D, BLOCK_H, TOK, CODE, True, MMA, MMA_I,
                                  LK, LAK, LAV, XMAX)

        # o^T = acc [D, BLOCK_H] / l
        _split_out(acc, l_t, m_i, OUT, OP, LSE, b, h, s, num_splits, stride_ob,  # noqa: F821
                   stride_oh, v_out, G, BLOCK_H, D, SINGLE, 0, MMA)

    return _decode_8bit_gluon
