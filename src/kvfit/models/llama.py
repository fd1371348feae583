"""Llama-family decoder (Llama 2/3.x, Mistral, SmolLM, Qwen2/2.5 with q/k/v bias, Qwen3 with q/k
norm) driven by the HF ``config.json``. One class: the differences are flags read off the config.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    """QKV projection, optional q/k RMSNorm (Qwen3), RoPE, then ``ctx.backend.forward``."""

    def __init__(self, cfg, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=qkv_bias)
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too
        o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id, qkv_bias, qk_norm):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, qkv_bias, qk_norm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                            bias=getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, ctx):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg, qkv_bias, qk_norm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, qkv_bias, qk_norm)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder. ``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` in float32."""

    family = "llama"

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        mt = cfg.model_type
        qkv_bias = mt == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        qk_norm = mt == "qwen3"
        self.config = cfg
        self.model = LlamaModel(cfg, qkv_bias, qk_norm)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def kv_layer_specs(cls, cfg) -> list[KVLayerSpec]:
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return [KVLayerSpec("full", kv_heads, head_dim_of(cfg)) for _ in range(cfg.num_hidden_layers)]

    @classmethod
    def sm_scale(cls, cfg) -> float:
        return head_dim_of(cfg) ** -0.5

    def forward(self, input_ids, positions, ctx):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden):
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, w.t()).float()
