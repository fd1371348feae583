"""Split-K decode with several KV heads per program (``DecodeConfig.heads``), for small heads.

With G query heads per KV head the tensor-core tile pads the group to 16 MMA rows, so a 64-d
head of G = 3 spends 13/16 of its softmax on padding and, per KV byte, twice a 128-d head's
softmax work. Here one program reads the same tokens of HP consecutive KV heads (a request's
heads share its pages) as one ``[BLOCK_N, HP*D]`` tile and the query as a block-diagonal
``[16, HP*D]`` matrix: row ``hp*G + g`` holds query g of head hp in columns ``hp*D ..``, so
``Q'K'^T`` gives every row its own head's logits (the other heads' columns meet zeros) and one
``[16, BLOCK_N]`` softmax serves HP heads. ``P @ V'`` gives row r the columns of every head; the
diagonal blocks (row r, its head's D columns) are the outputs. Heads past the last KV head
(Hkv not a multiple of HP) are masked: no bytes read, their rows not stored.

K pages HND ``[pages, Hkv, P, D]``; V the same or token-minor ``[pages, Hkv, D, P]`` (``V_T``).
Addresses are built per page slice as in ``decode_kernels._tile_vt``. int8 pages: one float16
scale per (token, head), applied per logit (``[16, BLOCK_N]``) and per P entry before P@V.
Owns nothing; writes ``OUT`` or the split scratch ``OP``/``LSE`` (merged by the usual kernel).
"""

from __future__ import annotations

import functools

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build():
    """The jitted multi-head split kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.decode_common import build as build_decode_common
    from kvfit.kernels.pdl import gdc
    from kvfit.kernels.tile_math import build as build_tile_math

    common = build_decode_common()
    _cvt_one, _split_range = common.cvt_one, common.split_range
    _split_q_i8, _raw_logits = common.split_q_i8, common.raw_logits
    tile_math = build_tile_math()
    softcap_logits, online_softmax = tile_math.softcap_logits, tile_math.online_softmax
    gdc_wait, gdc_launch_dependents = gdc()

    @triton.jit
    def _heads_tile(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, col_off, s_row, rmask,
                    cmask, stride_cp, stride_sp, n0, lo, hi, qk_scale, softcap, qb, qoff,
                    D: tl.constexpr, W: tl.constexpr, M: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, F16: tl.constexpr, V_T: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, ROWS: tl.constexpr, I8_CVT: tl.constexpr,
                    K_CVT: tl.constexpr, MASKED: tl.constexpr):
        # the BLOCK_N tokens from n0 (a multiple of BLOCK_N) of HP heads: K' [BLOCK_N, W]
        PP: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
        NP: tl.constexpr = BLOCK_N // PP
        c = tl.arange(0, W)
        tp = tl.arange(0, PP)
        first = n0 + tl.arange(0, NP) * PP  # first token of each page slice, [NP]
        inpg = tl.multiple_of(n0 % PAGE, PP)
        pg = tl.load(bt_row + first // PAGE, mask=first < hi, other=0).to(tl.int64)
        n = first[:, None] + tp[None, :]  # [NP, PP]
        if MASKED:
            live = (n >= lo) & (n < hi)
        else:
            live = tl.full([NP, PP], 1, tl.int1)
        base = pg * stride_cp  # [NP]
        kptr = KC + base[:, None, None] + ((inpg + tp) * D)[None, :, None] + col_off[None, None, :]
        kmask = live[:, :, None] & cmask[None, None, :]
        k = tl.reshape(tl.load(kptr, mask=kmask, other=0.0), (BLOCK_N, W))  # [NP, PP, W]
        if V_T:  # token-minor V [H, D, P]: [W, NP, PP] -> [W, BLOCK_N] -> [BLOCK_N, W]
            vcol = col_off - (c % D) + (c % D) * PAGE  # head offset + d * PAGE
            vptr = VC + base[None, :, None] + vcol[:, None, None] + (inpg + tp)[None, None, :]
            vt = tl.load(vptr, mask=cmask[:, None, None] & live[None, :, :], other=0.0)
            v = tl.trans(tl.reshape(vt, (W, BLOCK_N)))
        else:
            vptr = VC + base[:, None, None] + ((inpg + tp) * D)[None, :, None] + \
                col_off[None, None, :]
            v = tl.reshape(tl.load(vptr, mask=kmask, other=0.0), (BLOCK_N, W))
        vis = tl.reshape(live, (BLOCK_N,))[None, :] & rmask[:, None]  # [M, BLOCK_N]
        ks = qk_scale
        vs = qk_scale
        if ROWS:  # int8: each row's head's scale of each token, [M, NP, PP] -> [M, BLOCK_N]
            soff = (pg * stride_sp)[None, :, None] + s_row[:, None, None] + \
                (inpg + tp)[None, None, :]
            smask = rmask[:, None, None] & live[None, :, :]
            ks = tl.reshape(tl.load(KS + soff, mask=smask, other=0.0), (M, BLOCK_N)).to(
                tl.float32)
            vs = tl.reshape(tl.load(VS + soff, mask=smask, other=0.0), (M, BLOCK_N)).to(
                tl.float32)
        v = _cvt_one(v, q, F16, I8_CVT)
        qk = _raw_logits(q, q_lo, k, qoff, F16, K_CVT)  # [M, BLOCK_N]
        if K_CVT == 4:
            qk = qk * qoff
        if ROWS:
            qk = qk * ks
        if HAS_SOFTCAP:
            qk = softcap_logits(qk + qb, qk_scale, softcap)
        else:
            qk = qk * qk_scale
        p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i, vis, True)
        if ROWS:
            p = p * vs
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="tf32")
        if I8_CVT == 2:  # v tiles hold v + 1152
            acc -= 1152.0 * tl.sum(p.to(v.dtype).to(tl.float32), axis=1)[:, None]
        return acc, m_new, l_i

    @triton.jit
    def _decode_split_heads(Q, KC, VC, KS, VS, QB, BT, KVLEN, OUT, OP, LSE,
                            qk_scale, softcap, window, v_scale,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cp, stride_ch, stride_sp, stride_sh, stride_bt, stride_qb,
                            num_splits, min_per,
                            G: tl.constexpr, HP: tl.constexpr, HKV: tl.constexpr,
                            D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                            F16: tl.constexpr, V_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr,
                            ROWS: tl.constexpr, I8_CVT: tl.constexpr, K_CVT: tl.constexpr,
                            HAS_QBIAS: tl.constexpr, PDL: tl.constexpr = False):
        # program (request b, heads [hb*HP, hb*HP + HP), split s); rows r = hp * G + g
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        M: tl.constexpr = 16
        W: tl.constexpr = HP * D
        b = tl.program_id(0)
        hb = tl.program_id(1)
        s = tl.program_id(2)
        lo, hi = _split_range(KVLEN, b, s, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        r = tl.arange(0, M)
        c = tl.arange(0, W)
        h0 = hb * HP
        rhead = h0 + r // G  # each row's KV head
        rmask = (r < HP * G) & (rhead < HKV)
        chead = h0 + c // D  # each column's KV head
        cmask = chead < HKV
        qmask = rmask[:, None] & ((r // G)[:, None] == (c // D)[None, :])
        q = tl.load(Q + b * stride_qt + (h0 * G + r)[:, None] * stride_qh + (c % D)[None, :],
                    mask=qmask, other=0.0)  # [M, W], block-diagonal
        if F16:
            q = q.to(tl.float16)
        qb = 0.0
        if HAS_QBIAS:
            qb = tl.load(QB + b * stride_qb + h0 * G + r, mask=rmask, other=0.0)[:, None]
        qoff = 0.0
        q_lo = q
        if K_CVT == 2:
            qoff = 1152.0 * tl.sum(q.to(tl.float32), axis=1)[:, None]
        if K_CVT >= 3:
            q, q_lo, qoff = _split_q_i8(q, K_CVT == 3)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, W], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        col_off = chead * stride_ch + c % D  # [W]
        s_row = rhead * stride_sh  # [M]
        n0 = lo // BLOCK_N * BLOCK_N
        if HAS_WINDOW:
            if n0 < lo:
                acc, m_i, l_i = _heads_tile(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row,
                                            col_off, s_row, rmask, cmask, stride_cp, stride_sp,
                                            n0, lo, hi, qk_scale, softcap, qb, qoff, D, W, M,
                                            PAGE, BLOCK_N, F16, V_T, HAS_SOFTCAP, ROWS, I8_CVT,
                                            K_CVT, True)
                n0 += BLOCK_N
        full_end = hi // BLOCK_N * BLOCK_N
        for t0 in range(n0, full_end, BLOCK_N):
            acc, m_i, l_i = _heads_tile(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, col_off,
                                        s_row, rmask, cmask, stride_cp, stride_sp, t0, lo, hi,
                                        qk_scale, softcap, qb, qoff, D, W, M, PAGE, BLOCK_N,
                                        F16, V_T, HAS_SOFTCAP, ROWS, I8_CVT, K_CVT, False)
        if (full_end < hi) & (full_end >= n0):
            acc, m_i, l_i = _heads_tile(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, col_off,
                                        s_row, rmask, cmask, stride_cp, stride_sp, full_end, lo,
                                        hi, qk_scale, softcap, qb, qoff, D, W, M, PAGE,
                                        BLOCK_N, F16, V_T, HAS_SOFTCAP, ROWS, I8_CVT, K_CVT,
                                        True)
        # row r's output: its head's D columns of acc ([M, HP, D] diagonal blocks)
        acc3 = tl.reshape(acc, (M, HP, D))
        mine = (tl.arange(0, HP)[None, :, None] == (r // G)[:, None, None])
        o = tl.sum(tl.where(mine, acc3, 0.0), axis=1)  # [M, D]
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = o / safe_l[:, None]
        d = tl.arange(0, D)
        hq = h0 * G + r
        if SINGLE:
            tl.store(OUT + b * stride_ot + hq[:, None] * stride_oh + d[None, :],
                     (o * v_scale).to(OUT.dtype.element_ty), mask=rmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (HKV * G) + hq) * num_splits + s  # [M]
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=rmask[:, None])
            tl.store(LSE + row, lse, mask=rmask)

    expose_for_interpreter(globals(), locals())
    return _decode_split_heads
