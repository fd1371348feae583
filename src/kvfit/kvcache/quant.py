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
