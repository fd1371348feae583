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

Tensor parallel: sharded like Llama (the same ``Attention`` and ``GatedMLP``; a
vocabulary-parallel embedding and LM head, the final soft-cap applied after the gather); each
rank's hybrid pool holds its KV heads of both page spaces, and the sliding page lists, kept by
rank 0's scheduler, travel in the step message.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from kvfit.models.llama import Attention, head_dim_of
from kvfit.parallel.layers import VocabParallelEmbedding, vocab_parallel_logits
from kvfit.parallel.layout import tp_refusals


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        raise ValueError(f"{cfg.model_type} config has no layer_types; kvfit needs transformers "
                         f">= 4.53 configs for Gemma")
    return list(types)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, qk_norm: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer_id, bool(getattr(cfg, "attention_bias", False)),
                                   qk_norm, norm_offset=1.0)  # Gemma's (1 + w) q/k norms
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)

    def forward(self, x, positions, rotary, ctx):
        h = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rotary, ctx))
        h, x = self.pre_feedforward_layernorm(h, x)  # x += h, then norm (one kernel on CUDA)
        return x + self.post_feedforward_layernorm(self.mlp(h))


class GemmaModel(nn.Module):
    def __init__(self, cfg, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
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
        # vocabulary-parallel like the embedding: the rank's (padded) rows of the head
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.num_q_heads_per_rank = self.model.layers[0].self_attn.num_heads

    @classmethod
    def tensor_parallel_refusals(cls, cfg, size: int) -> list[str]:
        """Why this model cannot split over ``size`` ranks (heads and MLP as Llama's)."""
        return tp_refusals(cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.intermediate_size, size)

    @classmethod
    def kv_layer_specs(cls, cfg) -> list[KVLayerSpec]:
        hd = head_dim_of(cfg)
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
        """float32 logits [N, vocab] (every rank gets all of them under tensor parallelism)."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, w, self.config.vocab_size)  # [N, vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
