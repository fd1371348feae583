"""GEMV for the token rows of a small decode step, with the decoder's neighbours fused in: the
fastest one-row product measured on the H200 (docs/benchmarks.md), run by
``models/decode_rows.py`` for one-token steps when the engine's ``decode_gemv`` is on.

Owns nothing; returns new tensors. ``y = x @ W.T`` for M token rows (x ``[M, K]``, W ``[N, K]``
row-major as ``nn.Linear`` stores it). One program computes ``BLOCK_N`` outputs of ``BLOCK_M``
rows over the whole K (no split-K: no reduce kernel, and every output is summed in one fixed
order); a tile with a fifth entry runs the persistent form, a grid of about one or two programs
per SM each computing several such blocks in one pipelined loop, with the same bits. The tile
depends on (N, K) only, M is a runtime argument that Triton never specializes, and a row's
values come from element-wise ops and per-row reductions: a row's outputs have the
same bits whatever M is and wherever the row sits in the step (tests/gpu/test_gemv_cuda.py).
They differ from a tensor-core GEMM's (other sums). The row blocks of one output block are
adjacent in launch order, so the blocks after the first read its weights from L2: HBM traffic
stays one pass over W, L2 traffic grows with M (measured: slower than cuBLAS from M = 2).
Optional parts, each replacing one launch of the unfused step:
* ``norm`` (``residual``-add + RMSNorm): every program reads its 2-8 KB input row (it is in L2)
  in the same pass as its weights, ``s = x + residual`` rounded like torch's add (the row's
  first program writes it: the new residual), accumulates ``sum(w_norm * s * W)`` and
  ``sum(s^2)`` together and scales by ``1/rms(s)`` at the end: no norm kernel and no second pass
  over the row. The normed input is not rounded to the dtype before the product (the unfused
  path rounds it twice), so outputs agree with the unfused kernels to within about one rounding
  of the input;
* ``gated`` epilogue: W holds ``[gate; up]`` (``[2I, K]``, ``GatedMLP.gate_up_proj``) and the
  output is ``act(gate) * up`` ``[M, I]`` with ``fused_act``'s roundings (activation in float32
  rounded to the dtype, then the product rounded once).
The dot products accumulate in float32 and round once to the dtype, like a cuBLAS GEMM; without
``norm`` only the summation order differs, so outputs agree with ``F.linear`` to within one
rounding.

At batch 1 a decode step is a chain of such GEMVs: reading the weights at the copy bandwidth is
the whole cost, and a cuBLAS GEMM of M = 1 reads them at 2.7-3.2 TB/s on the H200 with a split-K
reduce on ``down_proj`` (docs/benchmarks.md). ``GEMV_CONFIG`` holds the tile per (N, K) class.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kvfit.kernels.interpret import expose_for_interpreter
from kvfit.kernels.pdl import launch_options
from kvfit.kernels.rows_args import ACTIVATIONS, fits, gated_width, norm_prologue


@functools.cache
def build():
    """The jitted GEMV kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.gemm_epilogue import build as build_epilogue
    from kvfit.kernels.pdl import gdc

    gdc_wait, gdc_launch_dependents = gdc()
    _epilogue = build_epilogue()

    @triton.jit
    def _x_tile(X, R, RO, NW, x_off, k0, ks, mmask, write_res, K, offset, ssq, NORM: tl.constexpr,
                ADD: tl.constexpr, HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr):
        # the input tile [BM, BK] at k0 in float32; with NORM times the norm weight (ssq gains
        # its squares); with ADD x + residual rounded like torch's add: the new residual,
        # written where write_res
        if EVEN_K:
            xmask = mmask[:, None]
        else:
            km = (k0 + ks) < K
            xmask = mmask[:, None] & km[None, :]
        xk = tl.load(X + x_off + k0, mask=xmask, other=0.0)  # [BM, BK]
        if NORM:
            if ADD:
                rk = tl.load(R + x_off + k0, mask=xmask, other=0.0)
                xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(X.dtype.element_ty)
                if write_res:
                    tl.store(RO + x_off + k0, xk, mask=xmask)
            if EVEN_K:
                nw = tl.load(NW + k0 + ks).to(tl.float32)
            else:
                nw = tl.load(NW + k0 + ks, mask=km, other=0.0).to(tl.float32)
            sf = xk.to(tl.float32)
            ssq += sf * sf
            if HAS_OFFSET:
                xf = sf * (offset + nw)[None, :]
            else:
                xf = sf * nw[None, :]
        else:
            xf = xk.to(tl.float32)
        return xf, ssq

    # M is never specialized: every M runs the same binary, so a row's sums never depend on M
    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(X, R, RO, NW, W, B, OUT, M, K, N_OUT, stride_w, up_off, eps, offset,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM: tl.constexpr, ADD: tl.constexpr, HAS_OFFSET: tl.constexpr,
                     GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        # one program per (block of BLOCK_N outputs, block of BLOCK_M token rows): each weight
        # tile is loaded once and multiplied into every row of the block. Rows past M are
        # masked (zeros in, nothing out); the row blocks of an output block are adjacent in
        # launch order (L2 reuse when M > BLOCK_M). Every value of row m is computed by
        # element-wise ops and per-row reductions: its bits depend on neither M nor m.
        pid = tl.program_id(0)
        n_mb = tl.cdiv(M, BLOCK_M)
        mb = pid % n_mb
        nb = pid // n_mb
        ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] token rows
        mmask = ms < M
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows
        rmask = rows < N_OUT
        ks = tl.arange(0, BLOCK_K)
        # element-wise partial sums, reduced once after the loop (no cross-lane reduction per
        # tile); the loop is software-pipelined (STAGES tiles in flight through cp.async). With
        # NORM the mean square accumulates in the same pass and scales the sums at the end.
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        ssq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        x_off = ms[:, None] * K + ks[None, :]  # [BM, BK]
        w_ptr = W + rows.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BN, BK]
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            # the row block's first program writes its rows' residual
            xf, ssq = _x_tile(X, R, RO, NW, x_off, k0, ks, mmask, nb == 0, K, offset, ssq,
                                  NORM, ADD, HAS_OFFSET, EVEN_K)
            if EVEN_K:
                wmask = rmask[:, None]
            else:
                wmask = rmask[:, None] & ((k0 + ks) < K)[None, :]
            w = tl.load(w_ptr + k0, mask=wmask, other=0.0)
            acc3 += w.to(tl.float32)[None, :, :] * xf[:, None, :]
            if GATED:
                wu = tl.load(w_ptr + up_off * stride_w + k0, mask=wmask, other=0.0)
                acc3_up += wu.to(tl.float32)[None, :, :] * xf[:, None, :]
        # one reduction of the partial sums, then the shared epilogue (norm, bias, act, store)
        _epilogue(tl.sum(acc3, axis=2), tl.sum(acc3_up, axis=2), tl.sum(ssq, axis=1), B, OUT,
                  ms.to(tl.int64), rows, mmask, rmask, K, N_OUT, up_off, eps, NORM, GATED, ACT,
                  HAS_BIAS, X.dtype.element_ty)

    # The same product as a persistent program: a grid of P programs (about one or two per SM),
    # program p computes the blocks p, p + P, p + 2P, ... in one flattened loop over (block, k
    # tile), so its cp.async pipeline keeps STAGES weight tiles in flight across block
    # boundaries (no prologue/epilogue drain per block, no partial last wave). A block's sums run
    # in the same order with the same tile as _gemv_kernel's: the same bits.
    @triton.jit(do_not_specialize=["M"])
    def _gemv_persistent(X, R, RO, NW, W, B, OUT, M, K, N_OUT, stride_w, up_off, eps, offset,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NORM: tl.constexpr, ADD: tl.constexpr, HAS_OFFSET: tl.constexpr,
                         GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         EVEN_K: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        n_mb = tl.cdiv(M, BLOCK_M)
        n_blocks = tl.cdiv(N_OUT, BLOCK_N) * n_mb
        k_tiles = tl.cdiv(K, BLOCK_K)
        my_blocks = tl.cdiv(n_blocks - pid, n_prog)  # the grid never exceeds n_blocks
        ks = tl.arange(0, BLOCK_K)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        ssq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for it in tl.range(0, my_blocks * k_tiles, num_stages=STAGES):
            # the block and k tile are functions of the loop index alone (not carried through
            # the epilogue's branch): the pipeliner can compute the addresses STAGES ahead
            blk = pid + (it // k_tiles) * n_prog
            kt = it % k_tiles
            mb = blk % n_mb
            nb = blk // n_mb
            ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] token rows
            mmask = ms < M
            rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows
            rmask = rows < N_OUT
            k0 = kt * BLOCK_K
            x_off = ms[:, None] * K + ks[None, :]  # [BM, BK]
            xf, ssq = _x_tile(X, R, RO, NW, x_off, k0, ks, mmask, nb == 0, K, offset, ssq,
                                  NORM, ADD, HAS_OFFSET, EVEN_K)
            if EVEN_K:
                wmask = rmask[:, None]
            else:
                wmask = rmask[:, None] & ((k0 + ks) < K)[None, :]
            w_ptr = W + rows.to(tl.int64)[:, None] * stride_w + (k0 + ks)[None, :]  # [BN, BK]
            w = tl.load(w_ptr, mask=wmask, other=0.0)
            acc3 += w.to(tl.float32)[None, :, :] * xf[:, None, :]
            if GATED:
                wu = tl.load(w_ptr + up_off * stride_w, mask=wmask, other=0.0)
                acc3_up += wu.to(tl.float32)[None, :, :] * xf[:, None, :]
            if kt == k_tiles - 1:  # the block's last tile: finish and store it
                _epilogue(tl.sum(acc3, axis=2), tl.sum(acc3_up, axis=2), tl.sum(ssq, axis=1), B,
                          OUT, ms.to(tl.int64), rows, mmask, rmask, K, N_OUT, up_off, eps, NORM,
                          GATED, ACT, HAS_BIAS, X.dtype.element_ty)
                acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc3_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
                ssq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)

    expose_for_interpreter(globals(), locals())
    return _gemv_kernel, _gemv_persistent


# (block_n, block_k, num_warps, num_stages[, blocks per program]) for (n_out, k, gated,
# block_m): the tiles measured best one product at a time on the H200
# (benchmarks/kernels/gemv_bench.py, 2026-12-01, Qwen3-1.7B's shapes); other shapes take the
# rule in gemv_config, which gives 8 x 512 for qkv and gate/up. The per-(product, block_m) sweep
# of 2026-12-02 (gemv_rows_sweep.py) picked other qkv and gate/up tiles, which made the whole
# step slower (1,139 against 1,101 us, docs/benchmarks.md "GEMV rows"): kept as is. A fifth
# entry runs the persistent kernel with that many blocks per program: gate/up's 768 blocks as
# 256 programs of 3 took 16.1 us against 17.2 on the classic grid (1.45 waves); every other
# product measured slower persistent (gemv_persistent_sweep.py, 2026-12-03).
GEMV_CONFIG: dict = {(2048, 2048, False, 1): (8, 256, 4, 4), (2048, 6144, False, 1): (4, 512, 4, 4),
                     (151936, 2048, False, 1): (8, 512, 4, 3),
                     (6144, 2048, True, 1): (8, 512, 4, 3, 3)}
# token rows per program: one binary serves every M, and each weight tile loaded is multiplied
# into BLOCK_M rows (at M = 1 the other rows are masked). On the H200 (Qwen3-1.7B's 28 layers +
# LM head, docs/benchmarks.md "GEMV rows") block_m 2 / 4 / 8 took 1.15 / 1.45 / 2.5x block_m 1's
# time at M = 1 and beat cuBLAS only there (block_m 2: 0.965x its time): one row per program.
# Other values serve benchmarks (gemv's block_m argument).
BLOCK_M = 1
MIN_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): enough tiles in flight


def gemv_config(n_out: int, k: int, gated: bool, block_m: int = 1) -> tuple[int, ...]:
    """The tile ``(block_n, block_k, num_warps, num_stages[, blocks per program])`` for an
    output of ``n_out`` rows over ``k`` inputs (gated: two weight rows each) at ``block_m`` token
    rows per program: the measured one, else the widest row block that
    still gives ``MIN_PROGRAMS`` programs (at most 8 gated rows: each reads two weight tiles),
    with block_k shrunk so the float32 partial sums stay at 32 per thread per weight tile."""
    if (n_out, k, gated, block_m) in GEMV_CONFIG:
        return GEMV_CONFIG[(n_out, k, gated, block_m)]
    bk = max(64, 512 // block_m)
    for bn in ((8,) if gated else (16, 8)):
        if n_out // bn >= MIN_PROGRAMS:
            return (bn, bk, 4, 3)
    return (4, bk, 4, 3)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``gemv`` runs this product on the GPU: CUDA token rows, 16-bit, the weight's
    dtype, a row-major weight."""
    return x.is_cuda and fits(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         norm: Optional[tuple[torch.Tensor, float, float]] = None,
         residual: Optional[torch.Tensor] = None, gated_act: Optional[str] = None,
         out_dtype: Optional[torch.dtype] = None,
         config: Optional[tuple[int, ...]] = None, block_m: Optional[int] = None):
    """Token rows ``x [M, K]`` times ``weight [N, K]`` (+ ``bias [N]``) -> ``[M, N]``.

    ``out_dtype=torch.float32`` returns the dtype-rounded values widened to float32 (what
    ``F.linear(x, w).float()`` gives, in one launch: the LM head's logits).
    ``norm = (norm_weight [K], eps, offset)``: the input is ``RMSNorm(x)`` (or, with
    ``residual [M, K]``, ``RMSNorm(x + residual)``), not rounded before the product; returns
    ``(y, s)`` with the new residual
    ``s = x + residual`` (``s = x`` without ``residual``, no copy). ``gated_act`` ("silu", ...):
    ``weight`` is ``[2I, K]`` = [gate; up] and ``y = act(gate) * up`` ``[M, I]``.
    ``config``: the tile (``gemv_config``'s form; default: ``gemv_config``'s answer).
    ``block_m``: token rows per program (default ``BLOCK_M``; a row's bits are the same for
    every M only at one block_m, so callers leave it alone but benchmarks). Never writes its
    inputs.
    """
    import triton

    if not fits(x, weight):
        raise ValueError(f"gemv wants 16-bit rows x [M, K] and a row-major weight [N, K] of "
                         f"its dtype on its device, got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    gated = gated_act is not None
    n_out = gated_width("gemv", n, gated_act)
    m = x.shape[0]
    x = x.contiguous()
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"gemv writes x's dtype or float32, not {out_dtype}")
    out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    nw, eps, offset, add = norm_prologue(x, k, norm, residual)
    if add:
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    else:
        residual, res_out = x, x
    bm = block_m or BLOCK_M
    tile = config or gemv_config(n_out, k, gated, bm)
    bn, bk, warps, stages = tile[:4]
    per_prog = tile[4] if len(tile) > 4 else 0
    bk = min(bk, triton.next_power_of_2(k))
    n_blocks = triton.cdiv(n_out, bn) * triton.cdiv(m, bm)
    args = (x, residual, res_out, nw, weight, weight if bias is None else bias, out, m, k, n_out,
            weight.stride(0), n_out, float(eps), float(offset))
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NORM=norm is not None, ADD=add,
                  HAS_OFFSET=bool(offset), GATED=gated, ACT=ACTIVATIONS.get(gated_act, 0),
                  HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, STAGES=stages,
                  num_warps=warps, num_stages=stages)
    classic, persistent = build()
    if per_prog:  # persistent: ceil(blocks / per_prog) programs, each up to per_prog blocks
        persistent[(triton.cdiv(n_blocks, per_prog),)](*args, **consts)
    else:
        classic[(n_blocks,)](*args, **consts, **launch_options(x.device))
    if norm is None:
        return out
    return out, res_out
