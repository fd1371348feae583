"""Host-side checks shared by the kernels that multiply a few token rows by a weight (``gemv``,
``rows_gemm``) with an optional RMSNorm prologue and a gated activation: which activations the
epilogues know (the code each kernel's ``ACT`` constexpr takes), whether rows and weight fit,
and the prologue's arguments. Owns nothing; raises ``ValueError`` naming the bad argument."""

from __future__ import annotations

import torch

# activation name -> the epilogues' ACT code (kernels/gemm_epilogue.py, kernels/fused_act.py)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
ROWS_DTYPES = (torch.bfloat16, torch.float16)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows ``x [M >= 1, K]`` of a 16-bit dtype and a row-major ``weight [N, K]`` of that dtype
    on x's device."""
    return (x.dim() == 2 and x.shape[0] >= 1 and x.dtype in ROWS_DTYPES
            and weight.dtype == x.dtype and weight.device == x.device and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1])


def gated_width(kernel: str, n: int, gated_act) -> int:
    """Output columns of ``n`` weight rows: ``n / 2`` when gated (``[gate; up]``), else ``n``."""
    if gated_act is None:
        return n
    if n % 2 or gated_act not in ACTIVATIONS:
        raise ValueError(f"gated {kernel} wants an even row count and an activation in "
                         f"{sorted(ACTIVATIONS)}, got {n} rows and {gated_act!r}")
    return n // 2


def norm_prologue(x: torch.Tensor, k: int, norm, residual):
    """``(norm weight, eps, offset, add)`` of the RMSNorm prologue (``norm`` = ``(weight [K], eps,
    offset)`` or None: then x stands in for the weight, eps and offset 0); ``add``: a residual
    ``[M, K]`` of x's dtype is added before the norm."""
    add = norm is not None and residual is not None
    if norm is None:
        nw, eps, offset = x, 0.0, 0.0
    else:
        nw, eps, offset = norm
        if nw.shape != (k,):
            raise ValueError(f"norm weight of shape {tuple(nw.shape)} does not match K={k}")
    if add and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    return nw, eps, offset, add
