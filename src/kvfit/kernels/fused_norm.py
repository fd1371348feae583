"""Fused RMSNorm (and residual-add + RMSNorm) in one Triton launch: the CUDA path of
``models.layers.RMSNorm``.

Owns nothing; returns new tensors, or writes the caller's contiguous ``out``/``residual_out``
(never its inputs). Same math as the torch
path, roundings included:

* ``offset == 0`` (HF Llama/Qwen): ``w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``, the
  product taken in the input dtype (float32 product of the two dtype values, rounded once, which
  is what torch does for 16-bit types);
* ``offset != 0`` (Gemma's ``1 + w``): ``(x_f32 * rsqrt(...) * (offset + w_f32)).to(dtype)``;
* ``fused_add_rms_norm``: ``s = (x + residual)`` rounded to x's dtype (the new residual), then the
  norm of ``s``.

Rows are the last dimension of a 2-D ``[T, N]`` or 3-D ``[T, heads, N]`` tensor (the q/k norm of
Qwen3/Gemma 3: rows of head_dim); the two leading dims may be strided (views of a fused QKV
output), the last must be contiguous. Only the sum of squares' order differs from torch (a
float32 tree reduction), so outputs agree to within one rounding of the output dtype.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kvfit.kernels.outputs import check_out


@functools.cache
def build():
    """The jitted (residual-add +) RMSNorm kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, ROUT, n_rows, heads, sx0, sx1, sr0, sr1, eps, offset,
                         N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] flat row
        cols = tl.arange(0, BLOCK_N)  # [BN]
        rmask = rows < n_rows
        t = rows // heads
        h = rows % heads
        mask = rmask[:, None] & (cols[None, :] < N)
        x = tl.load(X + (t * sx0 + h * sx1)[:, None] + cols[None, :], mask=mask, other=0.0)
        out_ty = X.dtype.element_ty
        if HAS_RES:
            r = tl.load(R + (t * sr0 + h * sr1)[:, None] + cols[None, :], mask=mask, other=0.0)
            s = (x.to(tl.float32) + r.to(tl.float32)).to(out_ty)  # rounded like torch's add
            tl.store(ROUT + rows[:, None] * N + cols[None, :], s, mask=mask)
            xf = s.to(tl.float32)
        else:
            xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / N  # [BR]
        rstd = tl.rsqrt(var + eps)
        normed = xf * rstd[:, None]
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            y = (normed * (offset + w)).to(out_ty)
        else:
            y = (normed.to(out_ty).to(tl.float32) * w).to(out_ty)
        tl.store(OUT + rows[:, None] * N + cols[None, :], y, mask=mask)

    return _rms_norm_kernel


def _rows_view(x: torch.Tensor):
    """(x', heads, stride0, stride1) with x' 2-D/3-D and its last dim contiguous."""
    if x.dim() not in (2, 3):
        x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch(x, residual, weight, eps, offset, out, rout):
    import triton

    shape = x.shape
    n = shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({n},)")
    xv, heads, sx0, sx1 = _rows_view(x)
    out = check_out(out, x, "out")
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(shape)}")
        if residual.dtype != x.dtype:
            residual = residual.to(x.dtype)
        rv, rheads, sr0, sr1 = _rows_view(residual)
        if rheads != heads:  # only when x and residual were reshaped differently
            xv, rv = xv.reshape(-1, n).contiguous(), rv.reshape(-1, n).contiguous()
            heads, sx0, sx1, sr0, sr1 = 1, n, 0, n, 0
        rout = check_out(rout, x, "residual_out")
    else:
        rv, sr0, sr1, rout = xv, 0, 0, out  # unused (HAS_RES=False)
    n_rows = out.numel() // n if n else 0
    if n_rows == 0:
        return out, rout
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(16, 2048 // block_n))  # several short rows (head_dim) per program
    num_warps = min(16, max(1, block_r * block_n // 256))
    grid = (triton.cdiv(n_rows, block_r),)
    build()[grid](xv, rv, weight, out, rout, n_rows, heads, sx0, sx1, sr0, sr1,
                  float(eps), float(offset), N=n, BLOCK_R=block_r, BLOCK_N=block_n,
                  HAS_RES=residual is not None, HAS_OFFSET=bool(offset), num_warps=num_warps)
    return out, rout


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ([T, N] or [T, heads, N]) -> new tensor (or ``out``),
    x's dtype."""
    return _launch(x, None, weight, eps, offset, out, None)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: float = 0.0, out: Optional[torch.Tensor] = None,
                       residual_out: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (x's dtype), returns ``(rms_norm(s), s)`` as two new tensors (or
    ``out``/``residual_out``)."""
    return _launch(x, residual, weight, eps, offset, out, residual_out)
