"""@triton.jit helpers shared by the decode and prefill kernels (compiled into their callers)."""

from __future__ import annotations

_K = {}


def build():
    """The shared helpers, built on first use (Triton is imported only then)."""
    if "k" in _K:
        return _K["k"]
    import triton
    import triton.language as tl

    @triton.jit
    def softcap_logits(qk, qk_scale, softcap):
        # softcap * tanh(qk * sm_scale / softcap) in base-2 logits; qk_scale = sm_scale * log2(e)
        x = qk * (qk_scale / 1.4426950408889634 / softcap)
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(x < 0, -th, th)
        return th * (softcap * 1.4426950408889634)

    _K["k"] = softcap_logits
    return softcap_logits
