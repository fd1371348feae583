"""Gemma 3 (text) and Gemma 2 decoders driven by the HF ``config.json`` (model_type ``gemma3_text``,
``gemma3`` text part not included, ``gemma2``).

What differs from Llama, each checked against HF transformers:
* embeddings are multiplied by sqrt(hidden_size) (cast to the weight dtype first, as HF does);
* every RMSNorm is ``x * (1 + w)`` (``offset=1``; GGUF files store ``1 + w``, the loader subtracts
  1 like transformers' GGUF reader, and maps ``ffn_norm`` to the pre-feedforward norm: both in
  ``models/weights.py``'s per-architecture tables);
* four norms per layer: input, post-attention, pre-feedforward, post-feedforward;
* Gemma 3: q/k RMSNorm per head, and a separate RoPE per layer type (``rope_parameters`` has
  ``sliding_attention`` and ``full_attention`` entries: θ 1e4 local, 1e6 global);
* ``layer_types``: sliding-window layers (``sliding_window`` tokens, own page space in
  ``HybridSWAKVCache``) and full layers;
* scores scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 caps attention logits
  (``attn_logit_softcapping``, carried by the backend: ``logit_softcap_of(cfg)``) and final logits
  (``final_logit_softcapping``, applied in ``compute_logits``);
* GeLU-tanh gated MLP; tied embeddings.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        raise ValueError(f"{cfg.model_type} config has no layer_types; kvfit needs transformers "
                         f">= 4.53 configs for Gemma")
    return list(types)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class GemmaAttention(nn.Module):
    """QKV projection, q/k norm (Gemma 3), RoPE of the layer's type, ``ctx.backend.forward``."""

    def __init__(self, cfg, layer_id: int, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = _head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, rotary, ctx):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = ctx.backend.forward(q, k, v, self.layer_id)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, qk_norm: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_id, qk_norm)
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)

    def forward(self, x, positions, rotary, ctx):
        h = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rotary, ctx))
        x = x + h
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, qk_norm)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)


class Gemma3ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32 (final soft-cap applied)."""

    family = "gemma"

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        qk_norm = cfg.model_type != "gemma2"
        self.layer_types = _layer_types(cfg)
        self.model = GemmaModel(cfg, qk_norm)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        rope = getattr(cfg, "rope_parameters", None) or {}
        if "sliding_attention" in rope or "full_attention" in rope:  # Gemma 3: θ per layer type
            self.rotary = nn.ModuleDict({lt: RotaryEmbedding(cfg, max_positions, layer_type=lt)
                                         for lt in sorted(set(self.layer_types))})
        else:  # Gemma 2: one RoPE
            one = RotaryEmbedding(cfg, max_positions)
            self.rotary = nn.ModuleDict({lt: one for lt in sorted(set(self.layer_types))})
        self.final_softcap: Optional[float] = getattr(cfg, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def kv_layer_specs(cls, cfg) -> list[KVLayerSpec]:
        hd = _head_dim(cfg)
        return [KVLayerSpec("sliding", cfg.num_key_value_heads, hd, cfg.sliding_window)
                if lt == "sliding_attention" else KVLayerSpec("full", cfg.num_key_value_heads, hd)
                for lt in _layer_types(cfg)]

    @classmethod
    def sm_scale(cls, cfg) -> float:
        return float(cfg.query_pre_attn_scalar) ** -0.5

    @classmethod
    def logit_softcap_of(cls, cfg) -> Optional[float]:
        """Attention-logit soft-cap the backend must apply (Gemma 2: 50.0; Gemma 3: None)."""
        return getattr(cfg, "attn_logit_softcapping", None)

    def forward(self, input_ids, positions, ctx):
        w = self.model.embed_tokens.weight
        # HF multiplies by the scale cast to the weight dtype (sqrt(640) -> 25.25 in bf16)
        x = self.model.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=w.dtype)
        for layer, lt in zip(self.model.layers, self.layer_types):
            x = layer(x, positions, self.rotary[lt], ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden):
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.matmul(hidden, w.t()).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
