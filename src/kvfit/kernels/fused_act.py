"""Fused gated activation ``act(gate) * up`` in one Triton launch: the CUDA path of
``models.layers.GatedMLP`` between its two matmuls.

Owns nothing; returns a new ``[..., I]`` tensor (or writes the caller's contiguous ``out``)
from ``gate_up [..., 2I]`` (gate first, as ``gate_up_proj`` lays them out). Roundings follow the
torch path ``act(gate) * up``: the activation is computed in float32 and rounded to the input
dtype, then the product is rounded once. Activations: ``silu``, ``gelu_pytorch_tanh`` (tanh
approximation), ``gelu`` (erf). The transcendental functions (exp, erf) may differ from CUDA's in
the last float32 bit, so outputs agree with torch's to within one rounding of the dtype; tanh-GeLU
is evaluated as ``x * sigmoid(2y)`` (= ``0.5 x (1 + tanh y)``), which avoids torch's cancellation
for x << 0.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kvfit.kernels.rows_args import ACTIVATIONS


@functools.cache
def build():
    """The jitted gated-activation kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _act_mul_kernel(X, OUT, n_inter, sx, ACT: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_inter
        ty = X.dtype.element_ty
        g = tl.load(X + t * sx + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(X + t * sx + n_inter + cols, mask=m, other=0.0).to(tl.float32)
        if ACT == 0:  # silu: x / (1 + exp(-x))
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # gelu tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g / (1.0 + tl.exp(-2.0 * y))  # 0.5 (1 + tanh(y)) = sigmoid(2y): no cancellation
        else:  # gelu erf: 0.5 x (1 + erf(x / sqrt(2)))
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        out = (a.to(ty).to(tl.float32) * u).to(ty)
        tl.store(OUT + t * n_inter + cols, out, mask=m)

    return _act_mul_kernel


def act_and_mul(gate_up: torch.Tensor, act: str = "silu",
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``act(gate_up[..., :I]) * gate_up[..., I:]`` -> new ``[..., I]`` tensor (or ``out``),
    gate_up's dtype."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} has no fused kernel; known: {', '.join(ACTIVATIONS)}")
    import triton

    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim {two_i} is odd: it must hold gate and up halves")
    inter = two_i // 2
    lead = gate_up.shape[:-1]
    x = gate_up.reshape(-1, two_i)  # [T, 2I]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((*lead, inter), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (*lead, inter) or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {gate_up.dtype} tensor of shape "
                         f"{(*lead, inter)}, got {out.dtype} {tuple(out.shape)}")
    t = x.shape[0]
    if t == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (t, triton.cdiv(inter, block))
    build()[grid](x, out, inter, x.stride(0), ACT=ACTIVATIONS[act], BLOCK=block,
                  num_warps=4 if block >= 512 else 1)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2I]`` -> ``[..., I]``."""
    return act_and_mul(gate_up, "silu")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up [..., 2I]`` -> ``[..., I]``."""
    return act_and_mul(gate_up, "gelu_pytorch_tanh")
