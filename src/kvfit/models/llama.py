"""Llama-family decoder (Llama 2/3.x, Mistral, SmolLM, Qwen2/2.5 with q/k/v bias, Qwen3 with q/k
norm) driven by the HF ``config.json``. One class: the differences are flags read off the config.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models import decode_rows
from kvfit.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from kvfit.parallel.layers import (RowParallelLinear, VocabParallelEmbedding,
                                   vocab_parallel_logits)
from kvfit.parallel.layout import shard_heads, tp_refusals
from kvfit.parallel.state import tp_group


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    """QKV projection, optional q/k RMSNorm (Qwen3), RoPE, then ``ctx.backend.forward``. The
    q/k norm runs inside the rotary call (one kernel with the RoPE on CUDA).

    Tensor parallel (``parallel/layout.py``): the rank holds its query heads and KV heads
    (``self.shard``) in ``qkv_proj`` (column-parallel) and their columns of ``o_proj``
    (row-parallel: one all-reduce); ``num_heads``/``num_kv_heads`` are the rank's."""

    def __init__(self, cfg, layer_id: int, qkv_bias: bool, qk_norm: bool,
                 norm_offset: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        g = tp_group()
        self.shard = shard_heads(total_heads, total_kv, g.rank, g.size)
        self.num_heads, self.num_kv_heads = self.shard.q_count, self.shard.kv_count
        self.head_dim = head_dim_of(cfg)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=qkv_bias)
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too
        o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def tp_slice(self, leaf: str, kind: str):
        """(dim, start, length) of checkpoint tensor ``{leaf}.{kind}`` this rank holds (its
        heads' rows of q/k/v, their columns of o_proj), None when it holds all of it."""
        d, sh = self.head_dim, self.shard
        if leaf == "q_proj":
            return 0, sh.q_start * d, sh.q_count * d
        if leaf in ("k_proj", "v_proj"):
            return 0, sh.kv_start * d, sh.kv_count * d
        if leaf == "o_proj" and kind == "weight":
            return 1, sh.q_start * d, sh.q_count * d
        return None

    def forward(self, x, positions, rotary, ctx):
        return self.o_proj(self.attend(self.qkv_proj(x), positions, rotary, ctx))

    def attend(self, qkv, positions, rotary, ctx):
        """qkv ``[T, q + 2 kv]`` (the projection's output) -> attention output ``[T, q]``, before
        o_proj. Mutates the KV pool (stores this step's K/V)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # q/k norm (Qwen3), then RoPE; on CUDA backends that allow it, the K/V store into the
        # pool runs in the same kernel (one launch per layer fewer)
        target = ctx.backend.kv_store_target(self.layer_id) if qkv.is_cuda else None
        kv_store = None if target is None else (v, target)
        q, k = rotary(positions, q, k, self.q_norm, self.k_norm, kv_store=kv_store)
        if kv_store is None:
            o = ctx.backend.forward(q, k, v, self.layer_id)  # [T, Hq, D]
        else:
            o = ctx.backend.forward(q, k, v, self.layer_id, kv_stored=True)
        return o.reshape(t, self.q_size)


class DecoderLayer(nn.Module):
    decode_gemv = False  # one-token steps through kernels/gemv.py (set_decode_gemv)

    def __init__(self, cfg, layer_id, qkv_bias, qk_norm):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, qkv_bias, qk_norm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                            bias=getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, ctx):
        """vLLM-style residual stream: ``x`` is the previous layer's MLP output (the embeddings,
        with ``residual`` None, for layer 0) and ``residual`` the stream before it; returns
        ``(mlp_out, residual)``. Each add is fused into the following norm (one kernel on CUDA);
        on the torch path the values equal ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` bit
        for bit. A small CUDA step (``decode_rows.path_of``: one token with ``decode_gemv``, or
        up to ``decode_rows.MAX_ROWS`` with its opt-in tensor-core path) runs
        ``decode_rows.layer_forward``: the same values (to within a rounding per product)
        through four fused launches."""
        path = decode_rows.path_of(self, x, residual)
        if path is not None:
            return decode_rows.layer_forward(self, path, x, residual, positions, rotary, ctx)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, qkv_bias, qk_norm):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, qkv_bias, qk_norm)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder. ``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` in float32."""

    family = "llama"
    decode_gemv = False

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        mt = cfg.model_type
        qkv_bias = mt == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        qk_norm = mt == "qwen3"
        self.config = cfg
        self.model = LlamaModel(cfg, qkv_bias, qk_norm)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # vocabulary-parallel like the embedding: the rank's (padded) rows of the head
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.num_q_heads_per_rank = self.model.layers[0].self_attn.num_heads

    def set_decode_gemv(self, on: bool) -> None:
        """Run one-token decode steps through the fused GEMV (``EngineConfig.decode_gemv``).
        Mutates this model's and its layers' flag; set it before capturing CUDA graphs."""
        self.decode_gemv = bool(on)
        for layer in self.model.layers:
            layer.decode_gemv = bool(on)

    @classmethod
    def tensor_parallel_refusals(cls, cfg, size: int) -> list[str]:
        """Why this model cannot split over ``size`` ranks (empty when it can)."""
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        return tp_refusals(heads, kv, cfg.intermediate_size, size)

    @classmethod
    def kv_layer_specs(cls, cfg) -> list[KVLayerSpec]:
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return [KVLayerSpec("full", kv_heads, head_dim_of(cfg)) for _ in range(cfg.num_hidden_layers)]

    @classmethod
    def sm_scale(cls, cfg) -> float:
        return head_dim_of(cfg) ** -0.5

    @classmethod
    def logit_softcap_of(cls, cfg) -> None:
        return None  # no attention-logit soft-capping in this family

    def forward(self, input_ids, positions, ctx):
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, self.rotary, ctx)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden):
        """float32 logits [N, vocab] (every rank gets all of them under tensor parallelism)."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if hidden.is_cuda:
            out = decode_rows.logits(hidden, w, self.decode_gemv)  # one rank, few rows: float32
            if out is not None:
                return out
        return vocab_parallel_logits(hidden, w, self.config.vocab_size)
