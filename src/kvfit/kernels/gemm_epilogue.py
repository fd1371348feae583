"""The output step shared by the row-product kernels (``kernels/gemv.py``,
``kernels/rows_gemm_kernel.py``): finished float32 sums ``[BM, BN]`` (and the up half's) ->
RMSNorm's 1/rms per row (the rows' sums of squares ``ssq [BM]``), the bias, one rounding to the
input dtype ``TY``, the gated ``act(gate) * up`` with ``kernels.fused_act``'s roundings, stored
at ``OUT[rows, cols]`` (row stride ``stride_o``). Owns nothing; writes ``OUT``."""

from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted epilogue (a helper the kernels inline), built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.interpret import expose_for_interpreter

    @triton.jit
    def _epilogue(acc, acc_up, ssq, B, OUT, rm64, rn, mmask, nmask, K, stride_o, up_off, eps,
                  NORM: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, TY: tl.constexpr):
        if NORM:  # RMSNorm's 1/rms per row, applied to the finished sums
            rstd = tl.rsqrt(ssq / K + eps)
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(B + up_off + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y = acc.to(TY)
        if GATED:  # act(gate) * up, as kernels.fused_act rounds it
            g = y.to(tl.float32)
            u = acc_up.to(TY).to(tl.float32)
            if ACT == 0:
                a = g / (1.0 + tl.exp(-g))
            elif ACT == 1:
                z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
                a = g / (1.0 + tl.exp(-2.0 * z))
            else:
                a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
            y = (a.to(TY).to(tl.float32) * u).to(TY)
        o_ptr = OUT + rm64[:, None] * stride_o + rn[None, :]
        tl.store(o_ptr, y.to(OUT.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    expose_for_interpreter(globals(), locals())
    return _epilogue
