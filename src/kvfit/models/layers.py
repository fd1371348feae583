"""Building blocks shared by the model families: norm, rotary embedding, gated MLP, attention.

Module names follow the HF checkpoints (``q_proj`` ...) except where two projections are fused
(``qkv_proj``, ``gate_up_proj``); the loaders concatenate the shards (see models/weights.py).

On CUDA tensors the norm, the rotary embedding and the gated activation run as fused Triton
kernels (``kvfit.kernels.fused_norm``/``fused_rope``/``fused_act``, imported on first use); on
other devices they run the torch code below, which is the reference the kernels are tested against.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvfit.parallel.layers import RowParallelLinear
from kvfit.parallel.state import tp_group

_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 like HF. ``offset`` = 1 for Gemma's (1 + w).

    ``forward(x)`` -> normed x (over the last dim). ``forward(x, residual)`` adds first, vLLM
    style: ``s = x + residual``, returns ``(norm(s), s)`` (the new residual stream), one kernel
    on CUDA. Never writes its inputs.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.is_cuda and self._fusable(x, residual):
            from kvfit.kernels.fused_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, self.offset)
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _fusable(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
        # the torch path's output dtype is promote(w, x) without offset: fuse where that is x's
        return (x.dtype in _FUSED_DTYPES and self.weight.device == x.device
                and (bool(self.offset) or self.weight.dtype == x.dtype)
                and (residual is None or (residual.dtype == x.dtype
                                          and residual.shape == x.shape)))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table; scaling (linear, llama3, yarn, ...) is
    computed by transformers' ``ROPE_INIT_FUNCTIONS`` from the same config, so it matches HF."""

    def __init__(self, hf_config, max_positions: int, layer_type: Optional[str] = None,
                 rope_params: Optional[dict] = None):
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(hf_config, layer_type, rope_params)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_positions, rot_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rot_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: Optional[RMSNorm] = None, k_norm: Optional[RMSNorm] = None,
                kv_store=None):
        """q [T, Hq, D], k [T, Hk, D] rotated at ``positions`` [T] (returns new tensors).

        With ``q_norm``/``k_norm`` (per-head RMSNorms, Qwen3) the norms are applied first:
        ``rope(q_norm(q)), rope(k_norm(k))``, in the same kernel on CUDA. With ``kv_store =
        (v, KVStoreTarget)`` the rotated k and v are also stored into the pool (in the same
        kernel on CUDA, else by the target's unfused store): mutates the target's caches."""
        if (q.is_cuda and q.dtype in _FUSED_DTYPES and k.dtype == q.dtype and q.dim() == 3
                and k.dim() == 3 and k.shape[-1] == q.shape[-1]
                and positions.device == q.device == self.cos.device):
            from kvfit.kernels.fused_rope import apply_rope

            if q_norm is None:
                return apply_rope(q, k, self.cos, self.sin, positions, kv_store=kv_store)
            if (q_norm._fusable(q, None) and k_norm._fusable(k, None)
                    and q_norm.eps == k_norm.eps and q_norm.offset == k_norm.offset):
                return apply_rope(q, k, self.cos, self.sin, positions, qk_norm=(
                    q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset), kv_store=kv_store)
            return apply_rope(q_norm(q), k_norm(k), self.cos, self.sin, positions,
                              kv_store=kv_store)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, rot_dim]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        q, k = _apply(q, cos, sin), _apply(k, cos, sin)
        if kv_store is not None:
            kv_store[1].store(k, kv_store[0])
        return q, k


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x, cos, sin):
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]  # partial rotary
    return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)


def _rope_inv_freq(hf_config, layer_type, rope_params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_params
    if params is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        if layer_type is not None and layer_type in params:
            params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads)
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; known: "
                                  f"default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if layer_type is not None:
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (and, on CUDA, the
    activation and the product fused into one kernel). Tensor parallel: the rank holds
    ``inter / size`` gate/up rows (column-parallel) and those columns of ``down_proj``
    (row-parallel: one all-reduce; ``reduce=False``: the rank's partial sum, the caller
    all-reduces, as a MoE layer does once for all its experts)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        g = tp_group()
        inter //= g.size
        self.inter_start = g.rank * inter  # the rank's rows of the checkpoint's gate/up
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, reduce=reduce)
        self.act_name = act
        self.act = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                    "gelu": F.gelu}[act]

    def tp_slice(self, leaf: str, kind: str):
        """(dim, start, length) of checkpoint tensor ``{leaf}.{kind}`` this rank holds (its
        gate/up rows, its down_proj columns), None when it holds all of it."""
        n = self.down_proj.weight.shape[1]
        if leaf in ("gate_proj", "up_proj"):
            return 0, self.inter_start, n
        if leaf == "down_proj" and kind == "weight":
            return 1, self.inter_start, n
        return None

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if gate_up.is_cuda and gate_up.dtype in _FUSED_DTYPES:
            from kvfit.kernels.fused_act import act_and_mul

            return self.down_proj(act_and_mul(gate_up, self.act_name))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
