"""Packed split-K decode for small query groups over HND pages (Triton): R sub-splits share one
16-row MMA, so the softmax works on real rows only.

With G query heads per KV head (G <= 4, padded to GP rows) the plain decode tile pads the query
group to 16 MMA rows: for G = 3 and 64-d heads 13 of 16 rows of every exp2 and max are waste,
and each KV byte carries twice the softmax work of a 128-d head. Here a tile of BLOCK_N keys is
read as ``[BLOCK_N / R, R * D]`` (R = 16 / GP consecutive tokens per row, contiguous within a
page), and the query as a block-diagonal ``[R * GP, R * D]`` matrix (row ``i * GP + g`` holds
query g in column block i). Then ``Q' K'^T`` ``[16, BLOCK_N / R]`` holds, in row ``i * GP + g``,
query g's logits against tokens ``R * a + i``: every logit exactly once, in R interleaved
sub-splits with their own running max and sum, at the MMA FLOPs of the plain tile and 1/R of
its softmax work. ``P' V'`` accumulates ``[16, R * D]``, whose diagonal blocks are the
sub-splits' outputs, merged by their log-sum-exp at the end (the same as a split-K merge).

Same arguments and outputs as ``decode_kernels._decode_split`` (int8 scales, softcap, window);
chosen by ``DecodeConfig.pack`` (``decode.choose_config``). Owns nothing.
"""

from __future__ import annotations

import functools

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build():
    """The jitted packed split kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.decode_common import build as build_decode_common
    from kvfit.kernels.pdl import gdc
    from kvfit.kernels.tile_math import build as build_tile_math

    common = build_decode_common()
    _to_mma, _split_range, _store_split = common.to_mma, common.split_range, common.store_split
    tile_math = build_tile_math()
    softcap_logits, online_softmax = tile_math.softcap_logits, tile_math.online_softmax
    gdc_wait, gdc_launch_dependents = gdc()

    @triton.jit
    def _decode_split_packed(Q, KC, VC, KS, VS, QB, BT, KVLEN, OUT, OP, LSE,
                             qk_scale, softcap, window, v_scale,
                             stride_qt, stride_qh, stride_ot, stride_oh,
                             stride_cp, stride_ch, stride_sp, stride_sh, stride_bt, stride_qb,
                             num_splits, min_per,
                             G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                             D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             F16: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr, ROWS: tl.constexpr,
                             I8_CVT: tl.constexpr, HAS_QBIAS: tl.constexpr,
                             PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        M: tl.constexpr = R * GP  # MMA rows: sub-split i, query g -> row i * GP + g
        NR: tl.constexpr = BLOCK_N // R  # tile rows of R consecutive tokens
        W: tl.constexpr = R * D  # tile row width
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        lo, hi = _split_range(KVLEN, b, s, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        r = tl.arange(0, M)
        c = tl.arange(0, W)
        a = tl.arange(0, NR)
        g = r % GP
        blk_r = r // GP  # the sub-split of each MMA row
        blk_c = c // D  # the token of each tile column within its row
        qmask = (g < G)[:, None] & (blk_r[:, None] == blk_c[None, :])
        q = tl.load(Q + b * stride_qt + (h * G + g)[:, None] * stride_qh + (c % D)[None, :],
                    mask=qmask, other=0.0)  # [M, W], block-diagonal
        if F16:
            q = q.to(tl.float16)
        qb = 0.0  # q . k_mean of each row's query, added before the softcap
        if HAS_QBIAS:
            qb = tl.load(QB + b * stride_qb + h * G + g, mask=g < G, other=0.0)[:, None]
        qoff = 0.0  # biased int8 tiles hold k + 1152: q . k = dot - 1152 * sum(q)
        if I8_CVT == 2:
            qoff = 1152.0 * tl.sum(q.to(tl.float32), axis=1)[:, None]
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, W], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        s_head = h * stride_sh
        for t0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            tok_a = t0 + R * a  # first token of each tile row, [NR]
            pg = tl.load(bt_row + tok_a // PAGE, mask=tok_a < hi, other=0).to(tl.int64)
            off = pg * stride_cp + head_off + (tok_a % PAGE) * D  # [NR]
            tok_c = tok_a[:, None] + blk_c[None, :]  # [NR, W]
            live_c = (tok_c >= lo) & (tok_c < hi)
            k = tl.load(KC + off[:, None] + c[None, :], mask=live_c, other=0.0)
            v = tl.load(VC + off[:, None] + c[None, :], mask=live_c, other=0.0)
            k, v = _to_mma(k, v, q, F16, I8_CVT)
            qk = tl.dot(q, tl.trans(k), input_precision="tf32") - qoff  # [M, NR]
            tok_r = tok_a[None, :] + blk_r[:, None]  # the token of each logit, [M, NR]
            vis = (tok_r >= lo) & (tok_r < hi)
            if ROWS:  # int8: each logit's key scale, each P entry's value scale
                soff = pg[None, :] * stride_sp + s_head + tok_r % PAGE
                qk = qk * tl.load(KS + soff, mask=vis, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                qk = softcap_logits(qk + qb, qk_scale, softcap)
            else:
                qk = qk * qk_scale
            p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i, vis, True)
            if ROWS:
                p = p * tl.load(VS + soff, mask=vis, other=0.0).to(tl.float32)
            p = p.to(v.dtype)
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="tf32")
            if I8_CVT == 2:  # v tiles hold v + 1152
                acc -= 1152.0 * tl.sum(p.to(tl.float32), axis=1)[:, None]
            m_i = m_new
        # merge the R sub-splits of each query: diagonal blocks of acc, weighted by exp2(m)
        acc4 = tl.reshape(acc, (R, GP, R, D))  # [sub-split, g, column block, d]
        ii = tl.arange(0, R)[:, None, None, None]
        jj = tl.arange(0, R)[None, None, :, None]
        accd = tl.sum(tl.where(ii == jj, acc4, 0.0), axis=2)  # [R, GP, D]
        m2 = tl.reshape(m_i, (R, GP))
        l2 = tl.reshape(l_i, (R, GP))
        mx = tl.max(m2, axis=0)  # [GP]
        w = tl.exp2(m2 - tl.where(mx == float("-inf"), 0.0, mx)[None, :])  # [R, GP]
        o = tl.sum(accd * w[:, :, None], axis=0)  # [GP, D]
        _store_split(OUT, OP, LSE, o, mx, tl.sum(l2 * w, axis=0), b, h, s, num_splits, v_scale,
                     stride_ot, stride_oh, G, GP, D, SINGLE)

    expose_for_interpreter(globals(), locals())
    return _decode_split_packed
