"""Paged split-K decode kernels (Triton): the @triton.jit code behind ``kernels.decode``.

Program (b, h, s) loads the G query heads that share KV head h once (padded to 16 rows for the
tensor-core ``tl.dot``), walks split s of request b's cached tokens in tiles of BLOCK_N tokens
through the block table, and keeps an online softmax in float32 (base-2 logits, the K scale
folded into the softmax scale, the V scale applied to the output). fp8 tiles become float16 in
registers (one packed cvt per two values); the query is cast to float16 with them.

Two tile loaders feed the same softmax/P@V step (``tile_math.tile_logits`` + ``softmax_pv``, shared with
prefill):

* ``_tile_hnd``: HND V pages ``[H, P, D]``, addresses per token, every tile masked (16-bit
  pools; the layout FlashInfer reads).
* ``_tile_vt``: token-minor V pages ``[H, D, P]`` (pool ``v_layout="HDN"``, used for fp8). The
  V tile arrives with P@V's reduction dim (the tokens) contiguous, the same operand shape as K,
  so an 8-bit V tile needs no transpose: with HND pages Triton gathers the fp8 V operand one
  byte at a time (``LDS.U8``, no 8-bit ``ldmatrix.trans``). Addresses are built per page
  (``[NP pages, PP tokens]``), so a page id is loaded once and Triton sees PP contiguous tokens;
  tiles wholly inside the split are unmasked, which makes both tiles 16-byte ``cp.async``
  copies. docs/kernels.md has the measurements.

``_decode_split_fma`` is the CUDA-core path (float32 queries or pools: exact products).
Kernels own nothing; they write ``OUT`` or the split scratch ``OP``/``LSE``.
"""

from __future__ import annotations

import functools

from kvfit.kernels.interpret import expose_for_interpreter, interpreting


@functools.cache
def build():
    """The jitted kernels (split, merge, split_fma), built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.tile_math import build as build_tile_math

    from kvfit.kernels.decode_common import build as build_decode_common
    from kvfit.kernels.pdl import gdc

    common = build_decode_common()
    _cvt_one, _split_range, _store_split = common.cvt_one, common.split_range, common.store_split
    _live_splits = common.live_splits
    _split_q_i8, _raw_logits = common.split_q_i8, common.raw_logits
    shared = build_tile_math()
    gdc_wait, gdc_launch_dependents = gdc()
    softcap_logits, scale_logits, softmax_pv = (shared.softcap_logits, shared.scale_logits,
                                                shared.softmax_pv)

    @triton.jit
    def _tile_hnd(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, head_off, s_head, stride_cp,
                  stride_sp, n0, lo, hi, qk_scale, softcap, qb, qoff, D: tl.constexpr,
                  PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, F16: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  ROWS: tl.constexpr, I8_CVT: tl.constexpr, K_CVT: tl.constexpr):
        # tokens [max(n0, lo), min(n0 + BLOCK_N, hi)) of HND pages, one address per token
        d = tl.arange(0, D)
        n = n0 + tl.arange(0, BLOCK_N)
        live = (n >= lo) & (n < hi)
        page = tl.load(bt_row + n // PAGE, mask=live, other=0).to(tl.int64)
        off = page * stride_cp + head_off + (n % PAGE) * D  # [BLOCK_N]
        k = tl.load(KC + off[:, None] + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(VC + off[:, None] + d[None, :], mask=live[:, None], other=0.0)
        ks = qk_scale
        vs = qk_scale
        if ROWS:  # int8: one float16 scale per token (dead tokens 0: stale bytes may be NaN)
            soff = page * stride_sp + s_head + n % PAGE
            ks = tl.load(KS + soff, mask=live, other=0.0).to(tl.float32)
            vs = tl.load(VS + soff, mask=live, other=0.0).to(tl.float32)
        v = _cvt_one(v, q, F16, I8_CVT)
        if K_CVT == 4:  # q's one factor for the tile, folded into the keys' scales
            ks = ks * qoff
        # [G_PAD, N] logits
        qk = scale_logits(_raw_logits(q, q_lo, k, qoff, F16, K_CVT), ks, qb, qk_scale, softcap,
                          HAS_SOFTCAP, ROWS)
        return softmax_pv(qk, v, vs, acc, m_i, l_i, live[None, :], True, ROWS, "tf32",
                          I8_CVT == 2)

    @triton.jit
    def _tile_vt(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, head_off, s_head, stride_cp,
                 stride_sp, n0, lo, hi, qk_scale, softcap, qb, qoff, D: tl.constexpr,
                 PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, F16: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 ROWS: tl.constexpr, I8_CVT: tl.constexpr, K_CVT: tl.constexpr,
                 MASKED: tl.constexpr):
        # the BLOCK_N tokens from n0 (a multiple of BLOCK_N); K HND, V token-minor [H, D, P]
        PP: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
        NP: tl.constexpr = BLOCK_N // PP
        d = tl.arange(0, D)
        tp = tl.arange(0, PP)
        first = n0 + tl.arange(0, NP) * PP  # first token of each page slice, [NP]
        inpg = tl.multiple_of(n0 % PAGE, PP)
        if MASKED:
            pg = tl.load(bt_row + first // PAGE, mask=first < hi, other=0).to(tl.int64)
            n = first[:, None] + tp[None, :]  # [NP, PP]
            live = (n >= lo) & (n < hi)
        else:
            pg = tl.load(bt_row + first // PAGE).to(tl.int64)
            live = tl.full([NP, PP], 1, tl.int1)
        base = pg * stride_cp + head_off  # [NP]
        kptr = KC + base[:, None, None] + ((inpg + tp) * D)[None, :, None] + d[None, None, :]
        vptr = VC + base[None, :, None] + (d * PAGE)[:, None, None] + (inpg + tp)[None, None, :]
        if MASKED:
            k = tl.load(kptr, mask=live[:, :, None], other=0.0)
            vt = tl.load(vptr, mask=live[None, :, :], other=0.0)
        else:
            k = tl.load(kptr)
            vt = tl.load(vptr)
        k = tl.reshape(k, (BLOCK_N, D))  # [NP, PP, D] -> [BLOCK_N, D]
        v = tl.trans(tl.reshape(vt, (D, BLOCK_N)))  # [D, NP, PP] -> [D, BLOCK_N] -> [BLOCK_N, D]
        ks = qk_scale
        vs = qk_scale
        if ROWS:  # int8: the tokens' float16 scales, [NP, PP] -> [BLOCK_N]
            sptr = KS + (pg * stride_sp + s_head)[:, None] + (inpg + tp)[None, :]
            vsptr = VS + (pg * stride_sp + s_head)[:, None] + (inpg + tp)[None, :]
            if MASKED:
                ks = tl.load(sptr, mask=live, other=0.0)
                vs = tl.load(vsptr, mask=live, other=0.0)
            else:
                ks = tl.load(sptr)
                vs = tl.load(vsptr)
            ks = tl.reshape(ks, (BLOCK_N,)).to(tl.float32)
            vs = tl.reshape(vs, (BLOCK_N,)).to(tl.float32)
        v = _cvt_one(v, q, F16, I8_CVT)
        if K_CVT == 4:  # q's one factor for the tile, folded into the keys' scales
            ks = ks * qoff
        # [G_PAD, N] logits
        qk = scale_logits(_raw_logits(q, q_lo, k, qoff, F16, K_CVT), ks, qb, qk_scale, softcap,
                          HAS_SOFTCAP, ROWS)
        return softmax_pv(qk, v, vs, acc, m_i, l_i, tl.reshape(live, (BLOCK_N,))[None, :], MASKED,
                          ROWS, "tf32", I8_CVT == 2)

    @triton.jit
    def _decode_split(Q, KC, VC, KS, VS, QB, BT, KVLEN, OUT, OP, LSE,
                      qk_scale, softcap, window, v_scale,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_cp, stride_ch, stride_sp, stride_sh, stride_bt, stride_qb,
                      num_splits, min_per, CNT,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      BLOCK_N: tl.constexpr, F16: tl.constexpr, V_T: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr,
                      ROWS: tl.constexpr, I8_CVT: tl.constexpr, HAS_QBIAS: tl.constexpr,
                      K_CVT: tl.constexpr = 0, PDL: tl.constexpr = False,
                      FUSED: tl.constexpr = False, S_PAD: tl.constexpr = 1):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        lo, hi = _split_range(KVLEN, b, s, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        if not SINGLE:
            if lo >= hi:  # an empty split: the merge counts the live ones from the context
                return
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        q = tl.load(Q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        if F16:
            q = q.to(tl.float16)
        qb = 0.0  # q . k_mean per query row, added before the softcap (centered K caches)
        if HAS_QBIAS:
            qb = tl.load(QB + b * stride_qb + h * G + g, mask=gmask, other=0.0)[:, None]
        # K_CVT: K's int8 conversion (V's is I8_CVT); biased tiles hold k + 1152: q . k =
        # dot - 1152 * sum(q)
        qoff = 0.0
        q_lo = q
        if K_CVT == 2:
            qoff = 1152.0 * tl.sum(q.to(tl.float32), axis=1)[:, None]
        if K_CVT >= 3:  # int8 MMAs on the stored keys: q as hi + lo / 254 (qoff: factor)
            q, q_lo, qoff = _split_q_i8(q, K_CVT == 3)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        s_head = h * stride_sh
        if V_T:
            # an unaligned first tile (a window's start), full unmasked tiles, a partial last
            n0 = lo // BLOCK_N * BLOCK_N
            if HAS_WINDOW:
                if n0 < lo:
                    acc, m_i, l_i = _tile_vt(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row,
                                             head_off, s_head, stride_cp, stride_sp, n0, lo, hi,
                                             qk_scale, softcap, qb, qoff, D, PAGE, BLOCK_N, F16,
                                             HAS_SOFTCAP, ROWS, I8_CVT, K_CVT, True)
                    n0 += BLOCK_N
            full_end = hi // BLOCK_N * BLOCK_N
            for t0 in range(n0, full_end, BLOCK_N):
                acc, m_i, l_i = _tile_vt(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, head_off,
                                         s_head, stride_cp, stride_sp, t0, lo, hi, qk_scale,
                                         softcap, qb, qoff, D, PAGE, BLOCK_N, F16, HAS_SOFTCAP,
                                         ROWS, I8_CVT, K_CVT, False)
            if (full_end < hi) & (full_end >= n0):
                acc, m_i, l_i = _tile_vt(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, head_off,
                                         s_head, stride_cp, stride_sp, full_end, lo, hi,
                                         qk_scale, softcap, qb, qoff, D, PAGE, BLOCK_N, F16,
                                         HAS_SOFTCAP, ROWS, I8_CVT, K_CVT, True)
        else:
            # tiles at multiples of BLOCK_N (a window's first tile masked below lo): aligned
            # token indices let the page-id loads and addresses vectorise as without a window
            for t0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
                acc, m_i, l_i = _tile_hnd(q, q_lo, acc, m_i, l_i, KC, VC, KS, VS, bt_row, head_off,
                                          s_head, stride_cp, stride_sp, t0, lo, hi, qk_scale,
                                          softcap, qb, qoff, D, PAGE, BLOCK_N, F16, HAS_SOFTCAP,
                                          ROWS, I8_CVT, K_CVT)
        _store_split(OUT, OP, LSE, acc, m_i, l_i, b, h, s, num_splits, v_scale, stride_ot,
                     stride_oh, G, G_PAD, D, SINGLE)
        if FUSED:  # the last live split of (b, h) to finish merges its G heads
            _merge_if_last(OP, LSE, OUT, CNT, KVLEN, b, h, num_splits, min_per, window, v_scale,
                           stride_ot, stride_oh, G, D, S_PAD, BLOCK_N, HAS_WINDOW)

    @triton.jit
    def _merge_row(OP, LSE, OUT, b, hq, HQ, n_live, num_splits, v_scale, stride_ot, stride_oh,
                   D: tl.constexpr, S_PAD: tl.constexpr, CG: tl.constexpr):
        # out[b, hq] = the lse-weighted mean of its first n_live split partials, times v_scale.
        # CG: read through L2 only (partials another program just wrote; L1 may hold stale
        # lines of an earlier call)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        row = (b * HQ + hq) * num_splits + sp
        smask = sp < n_live
        if CG:
            lse = tl.load(LSE + row, mask=smask, other=float("-inf"), cache_modifier=".cg")
        else:
            lse = tl.load(LSE + row, mask=smask, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx)
        den = tl.sum(w, axis=0)
        den = tl.where(den > 0, den, 1.0)
        live = smask & (lse > float("-inf"))  # empty splits (weight 0) are not read
        if CG:
            o = tl.load(OP + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0,
                        cache_modifier=".cg")
        else:
            o = tl.load(OP + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        o = tl.sum(o * w[:, None], axis=0) / den
        tl.store(OUT + b * stride_ot + hq * stride_oh + d, (o * v_scale).to(OUT.dtype.element_ty))

    if interpreting():  # programs run one after another there: nothing to order
        @triton.jit
        def _fence(x):
            return x
    else:
        @triton.jit
        def _fence(x):
            # every thread: its earlier global writes are visible GPU-wide before its later
            # ones (the store-then-count pattern of a last-block reduction)
            return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [x],
                                             dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _merge_if_last(OP, LSE, OUT, CNT, KVLEN, b, h, num_splits, min_per, window, v_scale,
                       stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr,
                       S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
        # count this split's partial in (CNT[b, h], zero between calls); the program that
        # counts the last live split (as _split_span cuts the context: empty splits exited
        # without counting) merges the group's heads and zeroes the count for the next call
        hkv = tl.num_programs(1)
        _fence(tl.arange(0, D))
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + b * hkv + h, 1, sem="acq_rel", scope="gpu")
        n_live = _live_splits(KVLEN, b, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        if ticket == n_live - 1:
            _fence(tl.arange(0, D))
            for g in tl.static_range(G):
                _merge_row(OP, LSE, OUT, b, h * G + g, hkv * G, n_live, num_splits, v_scale,
                           stride_ot, stride_oh, D, S_PAD, True)
            tl.atomic_xchg(CNT + b * hkv + h, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _decode_merge(OP, LSE, OUT, KVLEN, v_scale, stride_ot, stride_oh, num_splits, min_per,
                      window, HQ, D: tl.constexpr, S_PAD: tl.constexpr, LIVE: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        hq = tl.program_id(1)
        n_live = num_splits
        if LIVE:  # the splits with tokens, as _split_range cuts the context: empty ones wrote
            # nothing (their scratch rows hold another call's values)
            n_live = _live_splits(KVLEN, b, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        _merge_row(OP, LSE, OUT, b, hq, HQ, n_live, num_splits, v_scale, stride_ot, stride_oh,
                   D, S_PAD, False)

    @triton.jit
    def _decode_split_fma(Q, KC, VC, KS, VS, QB, BT, KVLEN, OUT, OP, LSE,
                          qk_scale, softcap, window, v_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_cp, stride_ch, stride_sp, stride_sh, stride_bt, stride_qb,
                          num_splits, min_per,
                          G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          SINGLE: tl.constexpr, ROWS: tl.constexpr, HAS_QBIAS: tl.constexpr,
                          PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        # CUDA-core path for small groups: only the G real query rows are computed. Partial
        # sums stay per (row, token slot, d) across tiles and are reduced once at the end, and
        # the running max is only moved when it grows by more than 2^8 (exact: the final
        # normalisation uses the same stale max), so a tile costs ~2G FMAs per KV element.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        start, end = _split_range(KVLEN, b, s, num_splits, min_per, window, BLOCK_N, HAS_WINDOW)
        if not SINGLE:
            if start >= end:  # an empty split: the merge counts the live ones from the context
                return
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        q = tl.load(Q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0).to(tl.float32)
        if not HAS_SOFTCAP:
            q = q * qk_scale
        qb = 0.0
        if HAS_QBIAS:
            qb = tl.load(QB + b * stride_qb + h * G + g, mask=gmask, other=0.0)[:, None]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l3 = tl.zeros([G_PAD, BLOCK_N], tl.float32)
        acc3 = tl.zeros([G_PAD, BLOCK_N, D], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
            off = page * stride_cp + head_off + (n % PAGE) * D
            k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            if V_T:  # token-minor V pages [H, D, P]
                offv = page * stride_cp + head_off + n % PAGE
                v = tl.load(VC + offv[:, None] + d[None, :] * PAGE, mask=nmask[:, None], other=0.0)
            else:
                v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            vf = v.to(tl.float32)
            if ROWS:  # int8: dequantize in registers (dead tokens' scales 0)
                soff = page * stride_sp + h * stride_sh + n % PAGE
                k = k.to(tl.float32) * tl.load(KS + soff, mask=nmask, other=0.0).to(
                    tl.float32)[:, None]
                vf = vf * tl.load(VS + soff, mask=nmask, other=0.0).to(tl.float32)[:, None]
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, N]
            if HAS_SOFTCAP:
                qk = softcap_logits(qk + qb, qk_scale, softcap)
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                acc3 = acc3 * alpha[:, None, None]
                l3 = l3 * alpha[:, None]
                m_i = m_new
            p = tl.exp2(qk - m_i[:, None])
            l3 += p
            acc3 += p[:, :, None] * vf[None, :, :]
        _store_split(OUT, OP, LSE, tl.sum(acc3, axis=1), m_i, tl.sum(l3, axis=1), b, h, s,
                     num_splits, v_scale, stride_ot, stride_oh, G, G_PAD, D, SINGLE)

    expose_for_interpreter(globals(), locals())
    return _decode_split, _decode_merge, _decode_split_fma


def merge_splits(op, lse, out, v_scale: float, num_splits: int, num_warps: int,
                 live=None) -> None:
    """Combine the split partials ``op [B * H * S, D]`` / ``lse [B * H * S]`` into ``out [B, H,
    D]`` (times ``v_scale``): the one launch of the merge for every split decode (MHA, int4,
    MLA). ``live = (kv_lens, min_per, window, block_n)``: the split kernels wrote only the
    splits holding tokens, cut as ``decode_common._split_span`` cuts the context (window None:
    none), and the merge reads only those; None: every split wrote its partial. Launched with
    PDL when ``kernels/pdl.py`` enables it (the merge waits for its predecessor first)."""
    import triton

    from kvfit.kernels.pdl import launch_options

    b, h, d = out.shape
    kv_lens, min_per, window, block_n = live if live is not None else (lse, 0, None, 1)
    build()[1][(b, h)](op, lse, out, kv_lens, float(v_scale), out.stride(0), out.stride(1),
                       num_splits, min_per, int(window or 0), h, D=d,
                       S_PAD=triton.next_power_of_2(num_splits), LIVE=live is not None,
                       BLOCK_N=block_n, HAS_WINDOW=window is not None, num_warps=num_warps,
                       **launch_options(out.device))
