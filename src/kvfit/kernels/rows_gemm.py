"""Batch-invariant small-M GEMM with the decoder's neighbours fused in: the CUDA linear layers of
a small step (x ``[M, K]`` times W ``[N, K]``, M = the decode batch; ``models/decode_rows.py``).

Owns nothing; returns new tensors (and, for split-K tiles, uses a shared zeroed counter buffer
that every launch leaves zeroed). Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of the
output over the whole K, or over one of ``split`` fixed K ranges whose partials the tile's last
program adds in split order: tensor-core ``tl.dot`` products chained through the float32
accumulator in K order (``rows_gemm_kernel.py``). A row's output therefore depends on the
weight's shape and the split count, not on the other rows: measured on the H200, the bits of a
row are the same for every tile of one split count (16 to 128 rows, swapped or not, block_k 64
to 256, 4 or 8 warps), so ``ROWS_CONFIG`` picks a tile per M bucket and keeps one split count
per shape. A request gets the same bits alone (M = 1, the other rows of its tile masked to
zero) and batched: batch invariance. cuBLAS picks its kernel per M (Qwen3-1.7B's down_proj:
split-K at M = 1 only), so its rows are not.

Optional parts, each replacing one launch of the unfused step:
* ``norm`` (``residual``-add + RMSNorm): ``s = x + residual`` rounded like torch's add (the
  programs of the first column block write it: the new residual); each row's sum of squares
  accumulates element-wise in K order and is reduced by a fixed pairwise tree over the
  ``block_k`` lanes (so it depends on block_k, not on the register layout); the dot reads
  ``s * w_norm`` rounded to the dtype and the finished sums are scaled by ``1/rms(s)``. Measured
  2-3x slower than the norm kernel + the plain product on the H200, so the engine does not use
  it (``decode_rows.FUSED_NORM_DTYPES``);
* ``gated`` epilogue: W holds ``[gate; up]`` (``[2I, K]``) and the output is ``act(gate) * up``
  ``[M, I]`` with ``fused_act``'s roundings;
* ``out_dtype=torch.float32``: the dtype-rounded values widened (the LM head's logits).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvfit.kernels.interpret import interpreting
from kvfit.kernels.pdl import launch_options
from kvfit.kernels.rows_args import ACTIVATIONS, fits, gated_width, norm_prologue
from kvfit.kernels.rows_gemm_kernel import build


class RowsConfig(NamedTuple):
    """A tile: ``swap`` computes ``W_tile @ x_tile^T`` (the weight's columns fill the MMA's
    long side, the batch rows its short one) instead of ``x_tile @ W_tile^T``; ``split``
    divides K into that many ranges (programs), their partials added in a fixed order."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: int = 0
    split: int = 1


# Tiles per (n_out, k, gated): ((max_m, tile), ...) in increasing max_m, the last one for any
# larger M. Measured on the H200 (benchmarks/kernels/rows_gemm_probe.py); other shapes take the
# rule in rows_config. A row's bits do not depend on the tile (every tile chains the same k16
# tensor-core products in K order; tests/gpu/test_rows_gemm_cuda.py checks it across the
# buckets), so the tile may follow M; the split count may not (each shape keeps one). The norm
# prologue's sum of squares is chained over 64-column chunks, the same for block_k 64-256.
ROWS_CONFIG: dict = {
    # Qwen3-1.7B's products (benchmarks/kernels/rows_gemm_probe.py, H200, round A2 of 2026-12-01;
    # us per product at M = 1 / 64, cuBLAS in brackets)
    (4096, 2048, False): ((16, (16, 32, 256, 4, 4)),  # qkv 7.8 (6.9)
                          (64, (16, 128, 128, 4, 3, 1)),  # 11.1 (7.3)
                          (1 << 30, (64, 64, 64, 4, 3))),
    (2048, 2048, False): ((1 << 30, (64, 64, 128, 4, 3, 0, 4)),),  # o 5.8 (5.4) / 7.3 (5.6)
    (6144, 2048, True): ((16, (16, 128, 128, 4, 3, 1)),  # gate_up 15.3 (15.9 + act)
                         (64, (32, 64, 128, 4, 3)),  # 19.8 (16.2 + act)
                         (1 << 30, (64, 128, 64, 4, 3, 1))),
    (2048, 6144, False): ((1 << 30, (64, 64, 128, 4, 3, 0, 4)),),  # down 12.2 (11.2) / 13.3 (11.5)
    (151936, 2048, False): ((16, (16, 128, 128, 4, 3, 1)),  # LM head 141.8 (150.4 + cast)
                            (64, (64, 128, 64, 8, 3)),  # 156.7 (160.6 + cast)
                            (1 << 30, (64, 128, 64, 4, 3, 1))),
}
# columns per chunk of the norm prologue's sum of squares (each chunk a fixed tree, chunks in
# K order): every table tile has block_k >= 64, so a row's 1/rms has the same bits whatever
# the tile (block_k 64, 128 and 256 all chain the same 64-column trees)
NORM_CHUNK = 64
MIN_PROGRAMS = 132  # one column block per SM of an H200 at least


def rows_config(n_out: int, k: int, gated: bool, m: int = 1) -> RowsConfig:
    """The tile for ``m`` rows and an output of ``n_out`` columns over ``k`` inputs (gated: two
    weight rows each): the measured one, else 16-row tiles with the widest column block that
    still gives ``MIN_PROGRAMS`` column blocks."""
    buckets = ROWS_CONFIG.get((n_out, k, gated))
    if buckets is not None:
        for max_m, tile in buckets:
            if m <= max_m:
                return RowsConfig(*tile)
        return RowsConfig(*buckets[-1][1])
    for bn in ((32, 16) if gated else (64, 32, 16)):
        if n_out // bn >= MIN_PROGRAMS:
            return RowsConfig(16, bn, 256, 4, 4)
    return RowsConfig(16, 16, 256, 4, 4)


_COUNTERS: dict = {}  # device -> zeroed int32 tile counters of split-K launches (see below)
_RETIRED: list = []  # smaller counter buffers replaced while CUDA graphs may still use them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` per-tile counters on ``device``, shared by every
    split-K launch (each tile's last program resets its counter, so it is zero between
    launches; launches on one stream never overlap, PDL included: every program waits for its
    predecessor first). Grows by replacement, keeping the old buffer alive for the graphs that
    captured it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``rows_gemm`` runs this product on the GPU: CUDA rows ``[M, K]``, 16-bit, the
    weight's dtype, a row-major weight."""
    return x.is_cuda and fits(x, weight)


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
              norm: Optional[tuple[torch.Tensor, float, float]] = None,
              residual: Optional[torch.Tensor] = None, gated_act: Optional[str] = None,
              out_dtype: Optional[torch.dtype] = None, config: Optional[tuple] = None):
    """``x [M, K]`` times ``weight [N, K]`` (+ ``bias [N]``) -> ``[M, N]``, each row's bits
    independent of M.

    ``out_dtype=torch.float32`` returns the dtype-rounded values widened to float32.
    ``norm = (norm_weight [K], eps, offset)``: the input is ``RMSNorm(x)`` (or, with
    ``residual [M, K]``, ``RMSNorm(x + residual)``); returns ``(y, s)`` with the new residual
    ``s = x + residual`` (``s = x`` without ``residual``, no copy). ``gated_act`` ("silu", ...):
    ``weight`` is ``[2I, K]`` = [gate; up] and ``y = act(gate) * up`` ``[M, I]``.
    ``config`` overrides the tile (benchmarks and tests). Never writes its inputs.
    """
    import triton

    if not fits(x, weight) or x.stride(1) != 1:
        raise ValueError(f"rows_gemm wants 16-bit rows x [M, K] (unit stride along K) and a "
                         f"row-major weight [N, K] of their dtype on their device, got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    gated = gated_act is not None
    n_out = gated_width("rows_gemm", n, gated_act)
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"rows_gemm writes x's dtype or float32, not {out_dtype}")
    out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    nw, eps, offset, add = norm_prologue(x, k, norm, residual)
    if add:
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual, res_out = x, x
    cfg = RowsConfig(*(config or rows_config(n_out, k, gated, m)))
    bk = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    ch = min(NORM_CHUNK, bk)  # the norm's sum-of-squares chunk: one order for every tile
    if norm is not None and bk // ch > 4:
        raise ValueError(f"rows_gemm's norm prologue takes tiles of at most {4 * NORM_CHUNK} "
                         f"columns, got block_k {bk}")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n_out, cfg.block_n), cfg.split)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), bk) * bk
    if cfg.split > 1:
        ws = torch.empty(cfg.split * m * n_out * (2 if gated else 1), dtype=torch.float32,
                         device=x.device)
        wsq = torch.empty(cfg.split * grid[1] * m if norm is not None else 1,
                          dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, grid[0] * grid[1])
    else:
        ws = wsq = cnt = out
    build()[grid](x, residual, res_out, nw, weight, weight if bias is None else bias, out, ws,
                  wsq, cnt, m, k, n_out, k_split, x.stride(0), residual.stride(0),
                  res_out.stride(0), weight.stride(0), out.stride(0), n_out, float(eps),
                  float(offset), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
                  LOG2_CH=ch.bit_length() - 1, SPLIT=cfg.split, NORM=norm is not None, ADD=add,
                  HAS_OFFSET=bool(offset), GATED=gated, ACT=ACTIVATIONS.get(gated_act, 0),
                  HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, STAGES=cfg.num_stages,
                  F32_DOT=interpreting(), SWAP=bool(cfg.swap), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **launch_options(x.device))
    if norm is None:
        return out
    return out, res_out
