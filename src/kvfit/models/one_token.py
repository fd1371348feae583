"""The one-token (batch-1 decode) path of a Llama-family decoder layer on CUDA: four GEMV launches
with the norms and the gated activation fused in (``kernels/gemv.py``), instead of two norm
kernels, four cuBLAS GEMMs (one with a split-K reduce) and the activation kernel.

    qkv, residual = gemv(W_qkv, RMSNorm_in(x + residual))       # norm prologue
    o             = attention (RoPE + K/V store, paged decode)  # as the batched path
    h             = gemv(W_o, o)
    a, residual   = gemv(W_gate_up, RMSNorm_post(h + residual)) # norm prologue, act(g)*u epilogue
    out           = gemv(W_down, a)

One rank only (``tp_group().size == 1``): under tensor parallelism the batched path runs, with
its all-reduces. Same values as the batched path to within about one rounding per product (the
GEMMs' summation order differs, and the normed input is not rounded before its product).

``ENABLED`` is OFF by default: a request's logits must not depend on whether it is alone in its
decode step (batch invariance: a seeded sampled request gives the same tokens alone and batched,
and overlap scheduling, which keeps a stopping request one step longer, changes batch sizes). On
the H200 the merged engine's tests/gpu/test_overlap_cuda.py failed with it on (a seeded sampled
row diverged after ~30 tokens between overlap on and off). Turn it on for A/B measurements
(benchmarks/engine/ab_decode_step.py ``--one-token on``); making it batch-invariant means running
every decode row through the same GEMV reduction order. ``LM_HEAD``: the
one-row LM head as a GEMV writing float32 logits (one launch instead of cuBLAS + a cast; 139.6
against 154.1 us on the H200 at Qwen3-1.7B's 151,936 x 2,048).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.parallel.state import tp_group

ENABLED = False
LM_HEAD = True


def _bias(lin) -> Optional[torch.Tensor]:
    return lin.bias


def applies(layer, x: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """True when ``layer`` (a ``llama.DecoderLayer``) runs ``x`` [1, hidden] on the GEMV path."""
    if not (ENABLED and x.dim() == 2 and x.shape[0] == 1) or tp_group().size > 1:
        return False  # tensor parallel: o_proj/down_proj all-reduce, the batched path does it
    from kvfit.kernels.gemv import ACTIVATIONS, supports

    attn, mlp = layer.self_attn, layer.mlp
    return (supports(x, attn.qkv_proj.weight) and mlp.act_name in ACTIVATIONS  # CUDA only
            and attn.o_proj.weight.dtype == x.dtype
            and mlp.gate_up_proj.weight.dtype == mlp.down_proj.weight.dtype == x.dtype
            and layer.input_layernorm._fusable(x, residual)
            and layer.post_attention_layernorm._fusable(x, residual))


def layer_forward(layer, x: torch.Tensor, residual: Optional[torch.Tensor], positions, rotary,
                  ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` for one token: ``(mlp_out [1, hidden], residual [1, hidden])``.
    Mutates the KV pool (this token's K/V) like the batched path."""
    from kvfit.kernels.gemv import gemv

    attn, mlp = layer.self_attn, layer.mlp
    n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
    qkv, residual = gemv(x, attn.qkv_proj.weight, _bias(attn.qkv_proj),
                         norm=(n_in.weight, n_in.eps, n_in.offset), residual=residual)
    o = attn.attend(qkv, positions, rotary, ctx)  # [1, q_size]
    h = gemv(o, attn.o_proj.weight, _bias(attn.o_proj))
    a, residual = gemv(h, mlp.gate_up_proj.weight, _bias(mlp.gate_up_proj),
                       norm=(n_post.weight, n_post.eps, n_post.offset), residual=residual,
                       gated_act=mlp.act_name)
    return gemv(a, mlp.down_proj.weight, _bias(mlp.down_proj)), residual


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """float32 logits ``[1, vocab]`` of one CUDA row through the GEMV, or None where the path
    does not apply (the caller runs its matmul)."""
    from kvfit.kernels.gemv import gemv, supports

    if not (ENABLED and LM_HEAD and supports(hidden, weight)) or tp_group().size > 1:
        return None
    return gemv(hidden, weight, out_dtype=torch.float32)
