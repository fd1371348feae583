"""Batch-invariant small-M GEMM with the decoder's neighbours fused in: the CUDA linear layers of
a decode step (x ``[M, K]`` times W ``[N, K]``, M = the decode batch).

Owns nothing; returns new tensors. Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of the
output over the whole K (no split-K): one tensor-core ``tl.dot`` per K tile, chained through
the float32 accumulator in K order. The tile (``RowsConfig``) is a function of the weight's
shape only, never of M, so a row's output is computed by the same instructions whether it is
alone (M = 1, the other rows of its tile masked to zero) or one of 256: its bits do not depend on
the batch (batch invariance: a seeded request samples the same tokens alone and batched). A
cuBLAS GEMM picks its kernel (and its split-K) per M, so its rows are not invariant.

Optional parts, each replacing one launch of the unfused step:
* ``norm`` (``residual``-add + RMSNorm): ``s = x + residual`` rounded like torch's add (the
  programs of the first column block write it: the new residual); the sum of squares of each row
  comes from the diagonal of ``s @ s^T`` through the same chained tensor-core products (an exact
  sum of one non-zero per row at the end, so it does not depend on the register layout of the
  tile either); the dot reads ``s * w_norm`` rounded to the dtype and the finished sums are
  scaled by ``1/rms(s)``;
* ``gated`` epilogue: W holds ``[gate; up]`` (``[2I, K]``) and the output is ``act(gate) * up``
  ``[M, I]`` with ``fused_act``'s roundings;
* ``out_dtype=torch.float32``: the dtype-rounded values widened (the LM head's logits).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from kvfit.kernels.interpret import interpreting
from kvfit.kernels.pdl import launch_options

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
ROWS_DTYPES = (torch.bfloat16, torch.float16)


class RowsConfig(NamedTuple):
    """A tile: ``swap`` computes ``W_tile @ x_tile^T`` (the weight's columns fill the MMA's
    long side, the batch rows its short one: wgmma on Hopper at any M) instead of
    ``x_tile @ W_tile^T``."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: int = 0


@functools.cache
def build():
    """The jitted kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.pdl import gdc

    gdc_wait, gdc_launch_dependents = gdc()

    # M is never specialised (1, multiples of 16): one binary per tile for every batch size
    @triton.jit(do_not_specialize=["M"])
    def _rows_gemm_kernel(X, R, RO, NW, W, B, OUT, M, K, N_OUT, stride_x, stride_r, stride_ro,
                          stride_w, stride_o, up_off, eps, offset,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORM: tl.constexpr, ADD: tl.constexpr, HAS_OFFSET: tl.constexpr,
                          GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          EVEN_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                          F32_DOT: tl.constexpr, SWAP: tl.constexpr):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        pid_m = tl.program_id(0)  # fastest: the row blocks of one weight tile run together
        pid_n = tl.program_id(1)
        ty = X.dtype.element_ty
        lm = tl.arange(0, BLOCK_M)
        rm = pid_m * BLOCK_M + lm  # [BM] batch rows
        mmask = rm < M
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
        nmask = rn < N_OUT
        ks = tl.arange(0, BLOCK_K)
        rm64 = rm.to(tl.int64)
        x_ptr = X + rm64[:, None] * stride_x + ks[None, :]  # [BM, BK]
        r_ptr = R + rm64[:, None] * stride_r + ks[None, :]
        ro_ptr = RO + rm64[:, None] * stride_ro + ks[None, :]
        w_ptr = W + rn.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BN, BK]
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                xm = mmask[:, None]
                wm = nmask[:, None]
            else:
                km = (k0 + ks) < K
                xm = mmask[:, None] & km[None, :]
                wm = nmask[:, None] & km[None, :]
            xk = tl.load(x_ptr + k0, mask=xm, other=0.0)  # [BM, BK]
            if NORM:
                if ADD:  # s = x + residual, rounded like torch's add: the new residual
                    rk = tl.load(r_ptr + k0, mask=xm, other=0.0)
                    xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(ty)
                    if pid_n == 0:
                        tl.store(ro_ptr + k0, xk, mask=xm)
                if F32_DOT:
                    sq = tl.dot(xk.to(tl.float32), tl.trans(xk.to(tl.float32)), sq)
                else:
                    sq = tl.dot(xk, tl.trans(xk), sq)  # [BM, BM]: diagonal = sum of squares
                if EVEN_K:
                    nw = tl.load(NW + k0 + ks).to(tl.float32)
                else:
                    nw = tl.load(NW + k0 + ks, mask=km, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    nw = nw + offset
                hk = (xk.to(tl.float32) * nw[None, :]).to(ty)
            else:
                hk = xk
            w = tl.load(w_ptr + k0, mask=wm, other=0.0)  # [BN, BK]
            if F32_DOT:  # the interpreter's 16-bit dot is wrong for bfloat16: exact widening
                hk = hk.to(tl.float32)
                w = w.to(tl.float32)
            if SWAP:
                acc = tl.dot(w, tl.trans(hk), acc)  # [BN, BM]
            else:
                acc = tl.dot(hk, tl.trans(w), acc)  # [BM, BN]
            if GATED:
                wu = tl.load(w_ptr + up_off * stride_w + k0, mask=wm, other=0.0)
                if F32_DOT:
                    wu = wu.to(tl.float32)
                if SWAP:
                    acc_up = tl.dot(wu, tl.trans(hk), acc_up)
                else:
                    acc_up = tl.dot(hk, tl.trans(wu), acc_up)
        if SWAP:  # [BN, BM] -> [BM, BN]
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        if NORM:  # RMSNorm's 1/rms per row, applied to the finished sums
            ssq = tl.sum(tl.where(lm[:, None] == lm[None, :], sq, 0.0), axis=1)  # [BM], exact
            rstd = tl.rsqrt(ssq / K + eps)
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(B + up_off + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y = acc.to(ty)
        if GATED:  # act(gate) * up, as kernels.fused_act rounds it
            g = y.to(tl.float32)
            u = acc_up.to(ty).to(tl.float32)
            if ACT == 0:
                a = g / (1.0 + tl.exp(-g))
            elif ACT == 1:
                z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
                a = g / (1.0 + tl.exp(-2.0 * z))
            else:
                a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
            y = (a.to(ty).to(tl.float32) * u).to(ty)
        o_ptr = OUT + rm64[:, None] * stride_o + rn[None, :]
        tl.store(o_ptr, y.to(OUT.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    return _rows_gemm_kernel


# Tiles per (n_out, k, gated): ((max_m, tile), ...) in increasing max_m, the last one for any
# larger M. Measured on the H200 (benchmarks/kernels/rows_gemm_probe.py); other shapes take the
# rule in rows_config. A row's bits do not depend on the tile (every tile chains the same k16
# tensor-core products in K order; tests/gpu/test_rows_gemm_cuda.py checks it across the
# buckets), so the tile may follow M.
ROWS_CONFIG: dict = {}
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


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] >= 1 and x.dtype in ROWS_DTYPES
            and weight.dtype == x.dtype and weight.device == x.device and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``rows_gemm`` runs this product on the GPU: CUDA rows ``[M, K]``, 16-bit, the
    weight's dtype, a row-major weight."""
    return x.is_cuda and _fits(x, weight)


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

    if not _fits(x, weight) or x.stride(1) != 1:
        raise ValueError(f"rows_gemm wants 16-bit rows x [M, K] (unit stride along K) and a "
                         f"row-major weight [N, K] of their dtype on their device, got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    gated = gated_act is not None
    if gated and (n % 2 or gated_act not in ACTIVATIONS):
        raise ValueError(f"gated rows_gemm wants an even row count and an activation in "
                         f"{sorted(ACTIVATIONS)}, got {n} rows and {gated_act!r}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"rows_gemm writes x's dtype or float32, not {out_dtype}")
    n_out = n // 2 if gated else n
    out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    add = norm is not None and residual is not None
    if norm is None:
        nw, eps, offset = x, 0.0, 0.0
    else:
        nw, eps, offset = norm
        if nw.shape != (k,):
            raise ValueError(f"norm weight of shape {tuple(nw.shape)} does not match K={k}")
    if add:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual, res_out = x, x
    cfg = RowsConfig(*(config or rows_config(n_out, k, gated, m)))
    bk = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n_out, cfg.block_n))
    build()[grid](x, residual, res_out, nw, weight, weight if bias is None else bias, out, m, k,
                  n_out, x.stride(0), residual.stride(0), res_out.stride(0), weight.stride(0),
                  out.stride(0), n_out, float(eps), float(offset), BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=bk, NORM=norm is not None, ADD=add,
                  HAS_OFFSET=bool(offset), GATED=gated, ACT=ACTIVATIONS.get(gated_act, 0),
                  HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, STAGES=cfg.num_stages,
                  F32_DOT=interpreting(), SWAP=bool(cfg.swap), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **launch_options(x.device))
    if norm is None:
        return out
    return out, res_out
