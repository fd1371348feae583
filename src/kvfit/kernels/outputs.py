"""Output buffers of the fused kernels: allocate one, or check a caller's (no triton import)."""

from __future__ import annotations

from typing import Optional

import torch


def check_out(out: Optional[torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
    """A new tensor like ``x``, or ``out`` if it is a contiguous tensor of x's shape and dtype."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out
