"""@triton.jit helpers of the decode kernels (split-K and packed): the tile conversion to the MMA
dtype, a split's token range, and a split's output (compiled into callers)."""

from __future__ import annotations

import functools
import types

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build() -> types.SimpleNamespace:
    """``to_mma``, ``split_range`` and ``store_split``, built on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.row_quant import build as build_row_quant

    rq = build_row_quant()
    i8_to_f16, i8_to_f16_biased = rq.i8_to_f16, rq.i8_to_f16_biased

    @triton.jit
    def _to_mma(k, v, q, F16: tl.constexpr, I8_CVT: tl.constexpr):
        # I8_CVT (int8 tiles): 1 four values per asm (no I2F), 2 the same + 1152 (the caller
        # corrects Q.K^T and P@V), 0 Triton's cast
        if I8_CVT == 1:
            return i8_to_f16(k), i8_to_f16(v)
        if I8_CVT == 2:
            return i8_to_f16_biased(k), i8_to_f16_biased(v)
        if F16:
            return k.to(tl.float16), v.to(tl.float16)
        return k.to(q.dtype), v.to(q.dtype)

    @triton.jit
    def _split_range(KVLEN, b, s, num_splits, window, BLOCK_N: tl.constexpr,
                     HAS_WINDOW: tl.constexpr):
        # tokens [lo, hi) of split s of request b; splits start at multiples of BLOCK_N. With a
        # window the splits share only the window's tiles (from the tile holding its first
        # token), so a long request's splits all have work and none reads a freed page.
        kv_len = tl.load(KVLEN + b)
        base = 0
        if HAS_WINDOW:
            base = tl.maximum(kv_len - window, 0) // BLOCK_N * BLOCK_N
        per = tl.cdiv(tl.cdiv(kv_len - base, num_splits), BLOCK_N) * BLOCK_N
        lo = base + s * per
        hi = tl.minimum(lo + per, kv_len)
        if HAS_WINDOW:
            lo = tl.maximum(lo, kv_len - window)
        return lo, hi

    @triton.jit
    def _store_split(OUT, OP, LSE, acc, m_i, l_i, b, h, s, num_splits, v_scale,
                     stride_ot, stride_oh, G: tl.constexpr, G_PAD: tl.constexpr,
                     D: tl.constexpr, SINGLE: tl.constexpr):
        # normalise; one split: the output (V scale applied), else the partial + its log-sum-exp
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        hq = h * G + g
        if SINGLE:
            tl.store(OUT + b * stride_ot + hq[:, None] * stride_oh + d[None, :],
                     (o * v_scale).to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + hq) * num_splits + s  # [G_PAD]
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(to_mma=_to_mma, split_range=_split_range,
                                 store_split=_store_split)
