"""@triton.jit helpers shared by the decode, prefill and store kernels (compiled into callers)."""

from __future__ import annotations

import functools
import types

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build() -> types.SimpleNamespace:
    """The shared helpers, built on first use (Triton is imported only then):
    ``softcap_logits``, ``tile_logits`` (Q@K^T, scaled or soft-capped), ``online_softmax`` (a
    tile into the running max and sum), ``softmax_pv`` (one tile of online softmax + P@V) and
    ``request_span``."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # the Triton interpreter looks them up there

    @triton.jit
    def softcap_logits(qk, qk_scale, softcap):
        # softcap * tanh(qk * sm_scale / softcap) in base-2 logits; qk_scale = sm_scale * log2(e)
        x = qk * (qk_scale / 1.4426950408889634 / softcap)
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(x < 0, -th, th)
        return th * (softcap * 1.4426950408889634)

    @triton.jit
    def scale_logits(qk, ks, qb, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr,
                     ROWS: tl.constexpr):
        # raw q . k [M, N] (f32) -> base-2 logits: ROWS: column j times its key's scale ks[j]
        # (folded with qk_scale into one factor per column when there is no softcap); qb
        # ([M, 1] or 0.0) added to the raw logits before the softcap
        if HAS_SOFTCAP:
            if ROWS:
                qk = qk * ks[None, :]
            return softcap_logits(qk + qb, qk_scale, softcap)
        if ROWS:
            return qk * (ks * qk_scale)[None, :]
        return qk * qk_scale

    @triton.jit
    def tile_logits(q, k, ks, qb, qoff, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr,
                    ROWS: tl.constexpr, PREC: tl.constexpr):
        # q [M, D], k [N, D] in the MMA dtype -> [M, N] f32 base-2 logits (qk_scale =
        # sm_scale * log2(e), softcap applied when HAS_SOFTCAP); ROWS: int8 keys, each column
        # times its key's scale ks [N] (f32) before the softcap; qb ([M, 1] or 0.0) is added
        # to the raw logits before the softcap (q . k_mean of a centered K cache); qoff ([M, 1]
        # or 0.0) is taken off the raw dot first (biased int8 tiles: 1152 * sum(q))
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) - qoff
        return scale_logits(qk, ks, qb, qk_scale, softcap, HAS_SOFTCAP, ROWS)

    @triton.jit
    def online_softmax(qk, m_i, l_i, visible, MASKED: tl.constexpr):
        # One tile of base-2 logits qk [M, N] into the running max and sum m_i/l_i [M]; visible
        # (broadcastable to [M, N]) is read only when MASKED. Returns (p [M, N] f32 = exp2(qk -
        # new max), alpha [M] = the factor that rescales the old accumulator, the new m_i, the
        # new l_i); the caller applies p and alpha to its own P@V.
        if MASKED:
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # row with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def softmax_pv(qk, v, vs, acc, m_i, l_i, visible, MASKED: tl.constexpr, ROWS: tl.constexpr,
                   PREC: tl.constexpr, VBIAS: tl.constexpr):
        # One tile of logits qk [M, N] into a running softmax: v [N, D] in the MMA dtype, acc
        # [M, D] f32, m_i/l_i [M] (base-2 running max and sum); visible (broadcastable to
        # [M, N]) is read only when MASKED; ROWS: int8 values, P's column j times vs[j] (f32)
        # before P@V. Returns the new (acc, m_i, l_i).
        p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i, visible, MASKED)
        if ROWS:
            p = p * vs[None, :]
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC)
        if VBIAS:  # v tiles hold v + 1152 (biased int8 conversion)
            acc -= 1152.0 * tl.sum(p.to(tl.float32), axis=1)[:, None]
        return acc, m_new, l_i

    @triton.jit
    def request_span(CU, KVLEN, req):
        # request req of a flat batch: (first row in q/k/v, new tokens, cached tokens before them)
        q_start = tl.load(CU + req)
        q_len = tl.load(CU + req + 1) - q_start
        return q_start, q_len, tl.load(KVLEN + req) - q_len

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(softcap_logits=softcap_logits, scale_logits=scale_logits,
                                 tile_logits=tile_logits, online_softmax=online_softmax,
                                 softmax_pv=softmax_pv, request_span=request_span)
