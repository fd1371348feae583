"""DeepSeek-V2 (and V2-Lite) decoder with Multi-head Latent Attention, driven by the HF
``config.json`` (model_type ``deepseek_v2``), checked against HF transformers.

MLA per layer (names as in the HF checkpoint):
* queries: ``q_proj`` (V2-Lite, ``q_lora_rank`` None) or ``q_a_proj`` -> ``q_a_layernorm`` ->
  ``q_b_proj``; per head ``qk_nope_head_dim`` + ``qk_rope_head_dim``;
* ``kv_a_proj_with_mqa`` -> latent ``c`` (``kv_lora_rank``, RMS-normed by ``kv_a_layernorm``) and
  one shared rope key ``k_pe`` (``qk_rope_head_dim``); only ``[c ; k_pe]`` is cached (MLAKVCache);
* ``kv_b_proj`` (``[H*(nope+v), kv_lora_rank]``) maps ``c`` to per-head ``k_nope`` and ``v``.

Weight-absorbed attention (prefill and decode): ``q_lat = W_UK^T q_nope`` per head, attention of
``[q_lat ; q_pe]`` over the cached slabs with values ``c`` (``ctx.backend.forward_mla``), then
``W_UV`` and ``o_proj``. The scores equal the expanded form's ``q_nope.k_nope + q_pe.k_pe``.

RoPE is DeepSeek's interleaved (complex-pair) rotation on the rope dims, with HF's scaling
(YaRN for V2/V2-Lite) from ``ROPE_INIT_FUNCTIONS``; the softmax scale is
``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``.

MLP: dense ``GatedMLP`` for the first ``first_k_dense_replace`` layers, then MoE (softmax router,
greedy or group-limited top-k, ``routed_scaling_factor``, shared experts); routed experts are
one GatedMLP each, loaded from the checkpoints' per-expert names (``mlp.experts.{e}.gate_proj``).

Tensor parallel (``kvfit/parallel``):
* attention: the query heads split over the ranks (``q_proj``/``q_b_proj`` and ``kv_b_proj``
  rows, ``o_proj`` columns: one all-reduce); the latent ``[c ; k_pe]`` is shared by all heads,
  so every rank computes it (``q_a_proj``, ``kv_a_proj_with_mqa`` replicated) and caches it
  whole: the KV capacity per GPU does not grow with the number of ranks;
* MoE: every expert's intermediate is sharded (each rank holds ``moe_intermediate_size / N``
  rows of every routed and shared expert), not expert parallelism: a decode step's weight reads
  split evenly over the ranks whatever the router chose (with whole experts on ranks, the step
  waits for the rank whose experts were chosen most), the loader's rule and the grouped GEMM
  are the dense MLP's, and the routed and shared experts' partial sums share one all-reduce
  per layer (docs/tensor_parallel.md);
* embedding and LM head vocabulary-parallel, as Llama's.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models.layers import GatedMLP, RMSNorm, _rope_inv_freq
from kvfit.parallel.layers import (RowParallelLinear, VocabParallelEmbedding,
                                   vocab_parallel_logits)
from kvfit.parallel.layout import divide_refusals, even_shard, head_refusals
from kvfit.parallel.state import all_reduce, tp_group

_ACT = {"silu": F.silu, "gelu": F.gelu}


class InterleavedRotary(nn.Module):
    """DeepSeek's RoPE: rotates pairs (x[2i], x[2i+1]) by position * inv_freq[i] (scaled cos/sin)."""

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(cfg, None, None)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [P, rot/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, rot] -> rotated copy (computed in float32, returned in x's dtype)."""
        cos = self.cos[positions][:, None, :]  # [T, 1, rot/2]
        sin = self.sin[positions][:, None, :]
        xf = x.float().unflatten(-1, (-1, 2))  # [T, H, rot/2, 2]
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)


def mla_sm_scale(cfg) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rp = getattr(cfg, "rope_parameters", None) or {}
    if rp.get("rope_type", "default") != "default":
        m_all = rp.get("mscale_all_dim", 0)
        factor = rp.get("factor", 1.0)
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """Latent projection, absorbed query, ``ctx.backend.forward_mla``, value up-projection.
    Tensor parallel: the rank's heads [head_start, head_start + num_heads) in the per-head
    projections; the latent whole (see the module docstring)."""

    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        g = tp_group()
        self.head_start, self.num_heads = even_shard(cfg.num_attention_heads, g.rank, g.size)
        h = self.num_heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        bias = bool(getattr(cfg, "attention_bias", False))
        qk = self.nope + self.rope
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # HF: default eps, not the config's
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(h * self.v_dim, cfg.hidden_size, bias=bias)

    def tp_slice(self, leaf: str, kind: str):
        """(dim, start, length) of checkpoint tensor ``{leaf}.{kind}`` this rank holds (its
        heads' rows of the query and kv_b projections, their columns of o_proj), None when it
        holds all of it (the latent projections)."""
        per_head = {"q_proj": self.nope + self.rope, "q_b_proj": self.nope + self.rope,
                    "kv_b_proj": self.nope + self.v_dim}.get(leaf)
        if per_head is not None:
            return 0, self.head_start * per_head, self.num_heads * per_head
        if leaf == "o_proj" and kind == "weight":
            return 1, self.head_start * self.v_dim, self.num_heads * self.v_dim
        return None

    def forward(self, x, positions, rotary, ctx):
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)  # [T, H, nope+rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)  # [T, rank]
        q_pe = rotary(positions, q_pe)
        k_pe = rotary(positions, k_pe[:, None, :])[:, 0]  # [T, rope]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        q_abs = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, rank+rope]
        kv = torch.cat((c, k_pe), dim=-1)  # [T, rank+rope]: the cached slab
        o_lat = ctx.backend.forward_mla(q_abs, kv, self.layer_id, self.rank)  # [T, H, rank]
        o = torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [T, H, v]
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))


@functools.cache
def grouped_gemm_available(device: torch.device) -> bool:
    """``torch._grouped_mm`` on bfloat16 runs here: torch has it, and on CUDA the GPU is sm_90+."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


class RoutedExperts(nn.ModuleList):
    """E gated experts, ``experts.{e}.gate_up_proj``/``down_proj`` (checkpoint names
    ``experts.{e}.gate_proj/up_proj/down_proj``, as DeepSeek and ``save_pretrained`` write them).

    Two ways to run them, same result: the loop over the experts a step chose (reads the chosen
    ids on the host: not CUDA-graph capturable), and, once ``stack_weights`` has put every
    expert's weights into one tensor per projection (the engine does after loading), grouped
    GEMMs over the (token, slot) pairs sorted by expert with no host sync (``torch._grouped_mm``;
    bfloat16 weights), which decode CUDA graphs capture."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str):
        # tensor parallel: each expert's intermediate sharded, partial sums (the MoE reduces)
        super().__init__(GatedMLP(hidden, inter, act, reduce=False) for _ in range(num_experts))
        self.act_name = act
        self.w_gate_up: torch.Tensor | None = None  # [E, 2I, H] after stack_weights
        self.w_down: torch.Tensor | None = None  # [E, H, I]

    @torch.no_grad()
    def stack_weights(self) -> None:
        """Move every expert's weights into ``w_gate_up``/``w_down`` (the experts' parameters
        become views of them: no extra memory once done). Bias-free experts only."""
        if self.w_gate_up is not None or any(e.gate_up_proj.bias is not None for e in self):
            return
        for name in ("gate_up_proj", "down_proj"):
            stacked = torch.stack([getattr(e, name).weight for e in self])  # [E, out, in]
            for i, e in enumerate(self):
                getattr(e, name).weight = nn.Parameter(stacked[i], requires_grad=False)
            setattr(self, "w_gate_up" if name == "gate_up_proj" else "w_down", stacked)

    def grouped(self, x, topk_idx, topk_w):
        """As ``forward``, by grouped GEMMs over the pairs sorted by expert (no host sync)."""
        t, k = topk_idx.shape
        e = self.w_gate_up.shape[0]
        flat = topk_idx.reshape(-1)  # [T*k]
        order = flat.argsort(stable=True)  # pairs grouped by expert
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's rows
        tok = order // k  # [T*k] token of each sorted pair
        gate_up = torch._grouped_mm(x[tok], self.w_gate_up.transpose(-2, -1), offs=offs)
        if gate_up.is_cuda:
            from kvfit.kernels.fused_act import act_and_mul

            h = act_and_mul(gate_up, self.act_name)  # [T*k, I]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self[0].act(gate) * up
        y = torch._grouped_mm(h, self.w_down.transpose(-2, -1), offs=offs)  # [T*k, H]
        y = y * topk_w.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    def every_expert(self, x, topk_idx, topk_w):
        """As ``forward``, running every expert on every token with the routing weights as a
        mask (no host sync, any dtype; E times the work: CUDA-graph capture of non-bf16 models)."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            w = (topk_w * (topk_idx == e)).sum(-1, keepdim=True)  # [T, 1], 0 if not routed
            out += (expert(x) * w).to(out.dtype)
        return out

    def forward(self, x, topk_idx, topk_w):
        """x [T, H], topk_idx/topk_w [T, k] -> [T, H] (weighted sum over each token's experts)."""
        if (self.w_gate_up is not None and x.dtype == torch.bfloat16
                and grouped_gemm_available(x.device)):
            return self.grouped(x, topk_idx, topk_w)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, topk_idx, topk_w)
        out = torch.zeros_like(x)
        for e in topk_idx.unique().tolist():
            tok, slot = torch.where(topk_idx == e)
            y = self[e](x[tok]) * topk_w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.method = getattr(cfg, "topk_method", "greedy") or "greedy"
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        if self.method not in ("greedy", "group_limited_greedy"):
            raise NotImplementedError(f"DeepSeek-V2 topk_method {self.method!r} is not supported "
                                      f"(greedy, group_limited_greedy)")
        self.gate = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = RoutedExperts(self.num_experts, cfg.hidden_size,
                                     cfg.moe_intermediate_size, cfg.hidden_act)
        self.shared_experts = GatedMLP(cfg.hidden_size,
                                       cfg.moe_intermediate_size * cfg.n_shared_experts,
                                       cfg.hidden_act, bias=bool(getattr(cfg, "mlp_bias", False)),
                                       reduce=False)

    def forward(self, x):
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)  # [T, E]
        if self.method == "group_limited_greedy":
            t = scores.shape[0]
            groups = scores.view(t, self.n_group, -1).max(dim=-1).values  # [T, G]
            keep = torch.zeros_like(groups).scatter_(
                1, torch.topk(groups, self.topk_group, dim=-1, sorted=False)[1], 1.0)
            mask = keep[:, :, None].expand(t, self.n_group, self.num_experts // self.n_group)
            scores = scores.masked_fill(~mask.reshape(t, -1).bool(), 0.0)
        w, idx = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        # tensor parallel: both are the rank's partial sums; one all-reduce for the layer
        return all_reduce(self.experts(x, idx, w * self.scaling) + self.shared_experts(x))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_id)
        if layer_id >= cfg.first_k_dense_replace and cfg.n_routed_experts:
            self.mlp = MoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                bias=bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, ctx):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden``; ``compute_logits`` float32.
    Needs a backend with ``forward_mla`` (one that lists ``MLAKVCache`` in its pools)."""

    family = "deepseek_v2"

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV2Model(cfg)
        self.rotary = InterleavedRotary(cfg, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # vocabulary-parallel like the embedding: the rank's (padded) rows of the head
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.num_q_heads_per_rank = self.model.layers[0].self_attn.num_heads

    @classmethod
    def tensor_parallel_refusals(cls, cfg, size: int) -> list[str]:
        """Why this model cannot split over ``size`` ranks: its query heads (the latent is not
        split), the dense MLP and the experts' intermediate sizes must divide evenly."""
        if size == 1:
            return []
        parts = {"the dense MLP's intermediate size": cfg.intermediate_size}
        if cfg.n_routed_experts:
            parts["the experts' intermediate size (moe_intermediate_size)"] = \
                cfg.moe_intermediate_size
        return (head_refusals(cfg.num_attention_heads, 1, size)
                + divide_refusals(size, parts))

    @classmethod
    def kv_layer_specs(cls, cfg) -> list[KVLayerSpec]:
        slab = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return [KVLayerSpec("mla", 1, slab) for _ in range(cfg.num_hidden_layers)]

    @classmethod
    def sm_scale(cls, cfg) -> float:
        return mla_sm_scale(cfg)

    @classmethod
    def logit_softcap_of(cls, cfg):
        return None

    def prepare_for_inference(self) -> None:
        """After the weights are loaded (the engine calls it): each MoE layer's experts stacked
        for grouped GEMMs, so a decode step has no host sync and CUDA graphs can capture it."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts.stack_weights()

    def forward(self, input_ids, positions, ctx):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden):
        """float32 logits [N, vocab] (every rank gets all of them under tensor parallelism)."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, w, self.config.vocab_size)
