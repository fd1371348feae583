"""The small-step path of a Llama-family decoder layer on CUDA: four batch-invariant launches per
layer instead of cuBLAS's products (one with a split-K reduce at M = 1), two norm kernels and the
activation kernel.

With the engine's ``decode_gemv`` (``LlamaForCausalLM.set_decode_gemv``), steps of up to
``GEMV_MAX_ROWS`` tokens (``kernels/gemv.py``, CUDA-core GEMVs, one program per (output block,
row block)):

    qkv, residual = gemv(W_qkv, RMSNorm_in(x + residual))          # norm in the prologue
    o             = attention (RoPE + K/V store, paged decode)      # as the batched path
    a, residual   = gemv(W_gate_up, RMSNorm_post(gemv(W_o, o) + residual), act(gate) * up)
    out           = gemv(W_down, a)

Opt-in (``ROWS_GEMM``), steps of up to ``MAX_ROWS`` tokens: the same four products through the
tensor-core ``kernels/rows_gemm.py`` with the norms in their own kernels (measured slower than
cuBLAS at batch 1 on the H200; invariant over more rows).

Within a path's row limit a request's hidden states and logits have the same bits whether it is
alone in its step or batched: each product's sums do not depend on the other rows, and the other
parts of a layer compute each row on its own (attention too, while the decode kernels split
every row's context the same way: contexts under 256 tokens, or batches whose split counts
agree; see docs/benchmarks.md). Steps of more tokens (larger decode batches, prefill chunks,
mixed steps) run the batched path (cuBLAS), whose bits differ: with the GEMV path's limit of one
row, a request decoded alone gets other bits than batched, hence ``decode_gemv`` is on by
default only where no step batches requests (``max_num_seqs`` = 1).

One rank only (``tp_group().size == 1``): under tensor parallelism the batched path runs, with
its all-reduces. Same values as the batched path to within about one rounding per product.
``LM_HEAD``: the logits of the step's rows through the same kind of product, written as float32
(one launch instead of cuBLAS + a cast).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.parallel.state import tp_group

# The GEMV path (per model: set_decode_gemv): steps of up to GEMV_MAX_ROWS tokens. On the H200
# (benchmarks/kernels/gemv_rows_bench.py, Qwen3-1.7B's 28 layers + LM head) its products take
# 0.80-0.84x cuBLAS's time at M = 1 and 1.15x at M = 2 (rows re-read the weights from L2), and
# programs of 2 / 4 rows were slower still at M = 1 (docs/benchmarks.md, "GEMV rows"): one row.
GEMV_MAX_ROWS = 1
# The tensor-core path (ROWS_GEMM, instead of the GEMV one when on). OFF by default: on the H200
# (round B, the same call as main) its batch-1 step was slower than main's cuBLAS path (fp8 557
# vs 590 tok/s, bf16 527 vs 558 at 1k: its products match cuBLAS but its GPU replay took ~100 us
# more). Turn it on for batch invariance of steps of up to MAX_ROWS tokens
# (tests/gpu/test_rows_gemm_cuda.py).
ROWS_GEMM = False
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


def path_for(x: torch.Tensor, gemv: bool) -> Optional[str]:
    """"gemv", "rows_gemm" or None (the batched path) for a step's ``x`` [M, hidden], ``gemv``
    the model's ``decode_gemv``."""
    if x.dim() != 2 or tp_group().size != 1:
        return None  # tensor parallel: o_proj/down_proj all-reduce, the batched path does it
    m = x.shape[0]
    if ROWS_GEMM:
        return "rows_gemm" if 1 <= m <= MAX_ROWS else None
    return "gemv" if gemv and 1 <= m <= GEMV_MAX_ROWS else None


def path_of(layer, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[str]:
    """The path ``layer`` (a ``llama.DecoderLayer``) runs ``x`` [M, hidden] on: "gemv",
    "rows_gemm", or None (the batched path)."""
    path = path_for(x, layer.decode_gemv)
    if path is None:
        return None
    if path == "gemv":
        from kvfit.kernels.gemv import ACTIVATIONS, supports
    else:
        from kvfit.kernels.rows_gemm import ACTIVATIONS, supports

    attn, mlp = layer.self_attn, layer.mlp
    ok = (supports(x, attn.qkv_proj.weight) and mlp.act_name in ACTIVATIONS  # CUDA only
          and attn.o_proj.weight.dtype == x.dtype
          and mlp.gate_up_proj.weight.dtype == mlp.down_proj.weight.dtype == x.dtype
          and layer.input_layernorm._fusable(x, residual)
          and layer.post_attention_layernorm._fusable(x, residual))
    return path if ok else None


def layer_forward(layer, path: str, x: torch.Tensor, residual: Optional[torch.Tensor],
                  positions, rotary, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` for the step's M tokens on ``path`` (``path_of``'s answer):
    ``(mlp_out [M, hidden], residual [M, hidden])``. Mutates the KV pool (this step's K/V) like
    the batched path."""
    if path == "gemv":
        return _gemv_layer(layer, x, residual, positions, rotary, ctx)
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


def _gemv_layer(layer, x, residual, positions, rotary, ctx):
    from kvfit.kernels.gemv import gemv

    attn, mlp = layer.self_attn, layer.mlp
    n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
    qkv, residual = gemv(x, attn.qkv_proj.weight, _bias(attn.qkv_proj),
                         norm=(n_in.weight, n_in.eps, n_in.offset), residual=residual)
    o = attn.attend(qkv, positions, rotary, ctx)  # [M, q_size]
    h = gemv(o, attn.o_proj.weight, _bias(attn.o_proj))
    a, residual = gemv(h, mlp.gate_up_proj.weight, _bias(mlp.gate_up_proj),
                       norm=(n_post.weight, n_post.eps, n_post.offset), residual=residual,
                       gated_act=mlp.act_name)
    return gemv(a, mlp.down_proj.weight, _bias(mlp.down_proj)), residual


def logits(hidden: torch.Tensor, weight: torch.Tensor, gemv: bool) -> Optional[torch.Tensor]:
    """float32 logits ``[N, vocab]`` of the step's CUDA rows where this path runs them, or None
    (the caller runs its matmul). ``gemv``: the model's ``decode_gemv``."""
    path = path_for(hidden, gemv)
    if not LM_HEAD or path is None:
        return None
    if path == "gemv":
        from kvfit.kernels.gemv import gemv as product, supports
    else:
        from kvfit.kernels.rows_gemm import rows_gemm as product, supports
    if not supports(hidden, weight):
        return None
    return product(hidden, weight, out_dtype=torch.float32)
