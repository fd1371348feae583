"""The small-step path of a Llama-family decoder layer on CUDA: the four products through the
batch-invariant small GEMM (``kernels/rows_gemm.py``), the gated activation in gate/up's
epilogue, instead of four cuBLAS GEMMs (one with a split-K reduce at M = 1) and the activation
kernel.

    h, residual   = RMSNorm_in(x + residual)            # the norm kernel, per row
    qkv           = rows_gemm(W_qkv, h)
    o             = attention (RoPE + K/V store, paged decode)   # as the batched path
    h, residual   = RMSNorm_post(rows_gemm(W_o, o) + residual)
    out           = rows_gemm(W_down, rows_gemm(W_gate_up, h, act(gate) * up))

(``FUSED_NORM_DTYPES`` would run the norms inside the GEMMs: measured slower, empty.) It runs
for every step of at most ``MAX_ROWS`` tokens, so a request's hidden states and logits have the
same bits whether it is alone in its step or batched with up to ``MAX_ROWS - 1`` others: each
product's sums do not depend on the other rows (``rows_gemm``), and the other parts of a layer
compute each row on its own (attention too, while the decode kernels split every row's context
the same way: contexts under 256 tokens, or batches whose split counts agree; see
docs/benchmarks.md). Steps of more tokens (larger decode batches, prefill chunks, mixed steps)
run the batched path (cuBLAS), whose bits differ from rows_gemm's.

One rank only (``tp_group().size == 1``): under tensor parallelism the batched path runs, with
its all-reduces. Same values as the batched path to within about one rounding per product.
``LM_HEAD``: the logits of up to ``MAX_ROWS`` rows through the same GEMM, written as float32
(one launch instead of cuBLAS + a cast).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.parallel.state import tp_group

# OFF by default: on the H200 (round B, the same call as main) this path's batch-1 step was
# slower than main's cuBLAS path (fp8 557 vs 590 tok/s, bf16 527 vs 558 at 1k: its products
# match cuBLAS but its GPU replay took ~100 us more), and the round's GPU tests with it on had
# five failures whose messages the slot cut off. Turn it on for batch invariance of steps of
# up to MAX_ROWS tokens (tests/gpu/test_rows_gemm_cuda.py).
ENABLED = False
# steps of up to MAX_ROWS tokens: where rows_gemm is as fast as cuBLAS on the H200 (Qwen3-1.7B
# shapes: on par at M = 1, 20-30% slower per product at M = 64, 2x at 256; docs/benchmarks.md)
MAX_ROWS = 16
LM_HEAD = True
# dtypes whose norms run inside the GEMMs (rows_gemm's norm prologue). None: on the H200 the
# fused prologue made the QKV product 3.3x slower than the norm kernel + the plain product
# (26 vs 7.8 us at M = 1); float16 could also overflow there (it rounds x * w_norm before
# 1/rms scales it). The norm kernels compute each row on its own, so they are batch-invariant.
FUSED_NORM_DTYPES: tuple = ()


def _bias(lin) -> Optional[torch.Tensor]:
    return lin.bias


def _rows_ok(x: torch.Tensor) -> bool:
    return ENABLED and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and tp_group().size == 1


def applies(layer, x: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """True when ``layer`` (a ``llama.DecoderLayer``) runs ``x`` [M, hidden] on this path."""
    if not _rows_ok(x):
        return False  # tensor parallel: o_proj/down_proj all-reduce, the batched path does it
    from kvfit.kernels.rows_gemm import ACTIVATIONS, supports

    attn, mlp = layer.self_attn, layer.mlp
    return (supports(x, attn.qkv_proj.weight) and mlp.act_name in ACTIVATIONS  # CUDA only
            and attn.o_proj.weight.dtype == x.dtype
            and mlp.gate_up_proj.weight.dtype == mlp.down_proj.weight.dtype == x.dtype
            and layer.input_layernorm._fusable(x, residual)
            and layer.post_attention_layernorm._fusable(x, residual))


def layer_forward(layer, x: torch.Tensor, residual: Optional[torch.Tensor], positions, rotary,
                  ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` for the step's M tokens: ``(mlp_out [M, hidden], residual
    [M, hidden])``. Mutates the KV pool (this step's K/V) like the batched path."""
    from kvfit.kernels.rows_gemm import rows_gemm

    attn, mlp = layer.self_attn, layer.mlp
    n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
    if x.dtype in FUSED_NORM_DTYPES:
        qkv, residual = rows_gemm(x, attn.qkv_proj.weight, _bias(attn.qkv_proj),
                                  norm=(n_in.weight, n_in.eps, n_in.offset), residual=residual)
    else:
        h, residual = (n_in(x), x) if residual is None else n_in(x, residual)
        qkv = rows_gemm(h, attn.qkv_proj.weight, _bias(attn.qkv_proj))
    o = attn.attend(qkv, positions, rotary, ctx)  # [M, q_size]
    h = rows_gemm(o, attn.o_proj.weight, _bias(attn.o_proj))
    if x.dtype in FUSED_NORM_DTYPES:
        a, residual = rows_gemm(h, mlp.gate_up_proj.weight, _bias(mlp.gate_up_proj),
                                norm=(n_post.weight, n_post.eps, n_post.offset),
                                residual=residual, gated_act=mlp.act_name)
    else:
        h, residual = n_post(h, residual)
        a = rows_gemm(h, mlp.gate_up_proj.weight, _bias(mlp.gate_up_proj),
                      gated_act=mlp.act_name)
    return rows_gemm(a, mlp.down_proj.weight, _bias(mlp.down_proj)), residual


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """float32 logits ``[N, vocab]`` of up to ``MAX_ROWS`` CUDA rows, or None where the path
    does not apply (the caller runs its matmul)."""
    if not (LM_HEAD and _rows_ok(hidden)):
        return None
    from kvfit.kernels.rows_gemm import rows_gemm, supports

    if not supports(hidden, weight):
        return None
    return rows_gemm(hidden, weight, out_dtype=torch.float32)
