"""Saturating quantize-on-store and dequantize-on-read for the KV pools (torch reference).

Plain ``x.to(torch.float8_e4m3fn)`` maps |x| > 448 to NaN. ``quantize`` divides by the per-tensor
scale, clamps to the format's finite range and only then casts, so no finite input stores NaN/Inf.
The GPU store kernels implement the same function (same rounding: round-to-nearest-even cast).
"""

from __future__ import annotations

import torch

from kvfit.kvcache.dtypes import KVFormat


def quantize(x: torch.Tensor, fmt: KVFormat, scale: float = 1.0) -> torch.Tensor:
    """x / scale, saturated to fmt's finite range, cast to fmt (returns a new tensor)."""
    if not fmt.quantized:
        return (x if scale == 1.0 else x / scale).to(fmt.torch_dtype)
    y = x.float()
    if scale != 1.0:
        y = y / scale
    # NOTE: not clamp_: for a float32 input with scale 1, y is x itself (the caller's tensor)
    return torch.clamp(y, -fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored elements back to ``dtype`` (the compute dtype), multiplied by the scale."""
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


# -- int8, one scale per (token, KV head) -----------------------------------------------------
INT8_MAX = 127
MIN_SCALE = 2.0 ** -14  # the smallest normal float16: a scale is never zero nor subnormal


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row of the last dim: x ``[..., D]`` -> (q int8 ``[..., D]``,
    scale float16 ``[...]``).

    ``amax = max|x|`` in float32; ``scale = float16(max(amax / 127, 2**-14))``;
    ``q = clamp(round_half_even(x / float32(scale)), -127, 127)``. A non-finite amax (an
    overflowed activation) saturates to the largest float16 scale, so every stored value is
    finite. Triton store kernels store the same bytes (IEEE division, round-half-even).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.clamp(amax / INT8_MAX, min=MIN_SCALE, max=torch.finfo(torch.float16).max)
    scale = torch.nan_to_num(scale, nan=torch.finfo(torch.float16).max).to(torch.float16)
    q = torch.round(xf / scale.float().unsqueeze(-1))  # torch.round is half-to-even
    q = torch.nan_to_num(torch.clamp(q, -INT8_MAX, INT8_MAX), nan=0.0)
    return q.to(torch.int8), scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 ``[..., D]`` times its row's float16 scale ``[...]`` -> ``dtype``."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
