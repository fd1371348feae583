"""Building blocks shared by the model families: norm, rotary embedding, gated MLP, attention.

Module names follow the HF checkpoints (``q_proj`` ...) except where two projections are fused
(``qkv_proj``, ``gate_up_proj``); the loaders concatenate the shards (see models/weights.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 like HF. ``offset`` = 1 for Gemma's (1 + w)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D] rotated at ``positions`` [T] (returns new tensors)."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, rot_dim]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return _apply(q, cos, sin), _apply(k, cos, sin)


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
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                    "gelu": F.gelu}[act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
