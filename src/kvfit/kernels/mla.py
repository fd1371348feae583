"""Paged MLA attention over the latent cache (Triton), host side: launch choices and launches.

``mla_decode`` (one query token per request, split-K over the context, every head of a request
in one program so a latent tile is read once per (request, split)) runs the row kernel of
``mla_kernels`` or, with ``MLAConfig.swap`` (the 16-bit default at <= 16 heads), the swapped
kernel of ``mla_decode_kernels``; ``mla_prefill`` (chunks of several tokens, causal over the
cached prefix, mixed batches) runs the row kernel; ``store_latent`` writes a step's new slabs into their slots with the pool's
quantize-on-store. Shapes: q ``[T, H, RANK + ROPE]`` (absorbed query ``[q_lat ; q_pe]``), cache
``[num_pages, P, RANK + ROPE]``, out ``[T, H, RANK]`` (the attention-weighted latent).

Decode launches depend only on (batch, splits): no host syncs, CUDA-graph capturable.
Owns nothing; writes ``out`` (and split scratch) or the cache.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvfit.kernels import decode_kernels, mla_decode_kernels, mla_gluon, mla_kernels
from kvfit.kernels.mla_gluon import gluon_fits

LOG2E = 1.4426950408889634
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_HOIST_TOKENS = 1024  # tokens per chunk of hoisted page ids (swapped decode)
# latent types whose default decode is the Gluon kernel where it runs (decode_config)
GLUON_DTYPES = (torch.bfloat16, torch.float16) + FP8
# e4m3 latents: the Gluon kernel's logits by fp8 MMAs over the stored bytes (GLUON_QFP8), and
# the pipelined kernel (mla_decode_fp8_pipe: tile i + 1's fp8 logits and conversion under tile
# i's; the default, measured 1.04-1.11x the plain Gluon kernel at 32-64 requests,
# docs/benchmarks.md)
GLUON_QFP8 = False
GLUON_PIPE = True
# latent types whose default Gluon decode is the register-operand kernel (mla_decode_fp8_regs:
# the tile from global memory straight into the logits MMA's A registers, 84 KB of shared
# memory, 2 programs an SM; float16 logits, where the pipelined e4m3 kernel rounds the query to
# fp8). Both 8-bit formats since the twenty-third session's exchange of the tile maximum and
# load placement (docs/benchmarks.md "MLA decode: one barrier for the tile maximum")
GLUON_REGS = FP8
# the register kernel: how many tiles ahead each tile's lines are asked of L2 (0: none; its
# tile loads wait on DRAM: 34% of its stall samples long-scoreboard, ncu, H100). sm_90 compile:
# 838 loop instructions against 813, 210 registers against 204, no spills. Off until timed on a
# GPU (benchmarks/gpu/reproduce.sh mla-l2)
GLUON_REGS_L2_AHEAD = 0
# 8-bit latents: values a thread converts at a time in the Gluon kernels (decode_config's
# conv_vec). 8: [1, 8] x [1, 32] per warp, conflict-free float16 stores into the swizzled tile,
# measured 1.10-1.13x the 16-value layout on the H200 (pipelined and plain kernels, 32 x 16k and
# 64 x 32k, docs/benchmarks.md "conv_vec")
GLUON_CONV_VEC = 8


@dataclass(frozen=True)
class MLAConfig:
    """Launch choices of one MLA attention call (decode: fixed per CUDA-graph batch size)."""

    block_m: int  # rows (token x head pairs) per program
    block_n: int  # latent tokens per tile
    num_warps: int
    num_stages: int
    num_splits: int = 1
    pairs: bool = True  # fp8: P@C operand from 16-bit words converted in registers
    swap: bool = False  # decode: heads as the MMAs' N dimension (mla_decode_kernels)
    qfp8: bool = False  # swapped e4m3 decode: logits by fp8 MMAs (query split in two fp8 parts)
    prefetch: bool = False  # swapped decode: next tile loaded into registers before this one
    hoist: int = 0  # swapped decode: page ids of this many tiles loaded before their loop
    gluon: bool = False  # decode: the Gluon kernel of mla_decode_gluon (Hopper warp-group MMAs)
    pipe: bool = False  # Gluon e4m3 decode: mla_decode_fp8_pipe (tile i + 1's work under tile i's)
    conv_vec: int = 8  # Gluon 8-bit decode: latent values a thread converts at a time (8 or 16)
    regs: bool = False  # Gluon 8-bit decode: mla_decode_fp8_regs (A operand from registers)
    l2_ahead: int = 0  # regs: tile i + l2_ahead's lines asked of L2 in tile i (0: none)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels: no inline PTX there."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _exact(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return q_dtype == torch.float32 or cache_dtype == torch.float32


def decode_config(batch: int, num_heads: int, rank: int, max_kv_len: int,
                  cache_dtype: torch.dtype, q_dtype: torch.dtype, num_sms: int = 132,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, num_splits: int | None = None,
                  swap: bool | None = None, qfp8: bool | None = None,
                  prefetch: bool | None = None, hoist: int | None = None,
                  programs_per_sm: int | None = None, gluon: bool | None = None,
                  rope: int = 64, pipe: bool | None = None,
                  conv_vec: int | None = None, regs: bool | None = None) -> MLAConfig:
    """Rows: every head of a request (at least 16 for the MMA, at most 32 per program: a
    [64, 512] float32 accumulator spills; larger head counts take several programs per request,
    adjacent in the grid so their shared latent tiles come from L2). ``swap``: the kernel with
    the heads as the MMAs' N (``mla_decode_kernels``; 16- and 8-bit latents), ``qfp8`` its
    e4m3 logits by fp8 MMAs, ``prefetch`` its next tile loaded into registers while this one is
    attended (no Triton pipelining), ``hoist`` the page ids of that many tiles loaded before
    their loop (so Triton's pipelining runs the tile loads num_stages - 1 ahead). ``gluon``:
    the Gluon kernel (``mla_decode_gluon``: 64-token tiles, one warp group, 16 heads a
    program, ``num_stages`` tiles of copies in flight; 512 + 64 slabs, 16-bit queries, sm_90);
    for e4m3 latents ``pipe`` (default ``GLUON_PIPE`` at 2 stages) the pipelined kernel of
    ``mla_decode_fp8_pipe``, with fp8 logits (``qfp8``, implied); ``conv_vec`` the values a
    thread converts at a time (default ``GLUON_CONV_VEC``, 8: conflict-free float16 stores,
    measured faster than 16). ``regs`` (8-bit latents; default: the latent type is in
    ``GLUON_REGS`` and no stages, fp8 logits, pipelined kernel or conversion width were asked
    for): the register-operand kernel of ``mla_decode_fp8_regs`` (no stages; 2 programs an SM
    for the split rule).
    Default (``swap`` and ``gluon`` None), from the H200 sweeps: the Gluon kernel where it fits
    and runs (``GLUON_DTYPES``); else 16-bit latents at <= 16 heads take the swapped kernel
    with hoisted page ids (32-token tiles, 4 warps, 4 stages); fp8, float32 and more heads the
    row kernel. Splits: the fewest waves per unit of work over ``num_sms`` SMs at the programs
    per SM each tile allows (``programs_per_sm`` overrides it), splits of >= 256 tokens, 1%
    merge cost per split. Ranks that are not a power of two keep one split (the merge kernel
    reads whole rows)."""
    exact = _exact(q_dtype, cache_dtype)
    fits = gluon_fits(rank, rope, cache_dtype, q_dtype)
    if gluon is None:
        gluon = (swap is None and fits and cache_dtype in GLUON_DTYPES
                 and mla_gluon.usable(torch.cuda.current_device()
                                      if torch.cuda.is_available() else 0))
    if gluon:
        if not fits:
            raise ValueError(f"the Gluon MLA decode takes 512 + 64 slabs of 16- or 8-bit latents "
                             f"and 16-bit queries, got rank {rank} + rope {rope}, {cache_dtype}, "
                             f"{q_dtype}: use gluon=False")
        # shared memory: STAGES copies of a tile (36.9 KB at 8 bits, 73.7 KB at 16), the
        # converted tile (73.7 KB, 8-bit only), the query (18.4 KB): 3 / 2 stages at most
        most = 3 if cache_dtype in FP8 else 2
        stages = num_stages or most
        if not 2 <= stages <= most:
            raise ValueError(f"the Gluon MLA decode takes 2..{most} stages for {cache_dtype} "
                             f"latents (shared memory), got {stages}")
        if regs is None:
            regs = cache_dtype in GLUON_REGS and num_stages is None and pipe is None \
                and qfp8 is None and conv_vec is None
        if regs and cache_dtype in FP8:
            return _with_splits(MLAConfig(16, 64, 4, 1, gluon=True, regs=True,
                                          l2_ahead=GLUON_REGS_L2_AHEAD), batch,
                                num_heads, rank, max_kv_len, num_sms, programs_per_sm or 2,
                                num_splits)
        e4m3 = cache_dtype == torch.float8_e4m3fn
        if pipe is None:  # the default unless stages or plain logits were asked for
            pipe = GLUON_PIPE and num_stages in (None, 2) and qfp8 is not False
        pipe = e4m3 and bool(pipe)
        qfp8 = pipe or (e4m3 and bool(GLUON_QFP8 if qfp8 is None else qfp8))
        if pipe:
            if num_stages not in (None, 2):
                raise ValueError(f"the pipelined Gluon MLA decode runs 2 stages, got {num_stages}")
            stages = 2
        conv_vec = GLUON_CONV_VEC if conv_vec is None else conv_vec
        if conv_vec not in (8, 16):
            raise ValueError(f"conv_vec is 8 or 16 latent values a thread, got {conv_vec}")
        return _with_splits(MLAConfig(16, 64, 4, stages, gluon=True, qfp8=qfp8, pipe=pipe,
                                      conv_vec=conv_vec), batch,
                            num_heads, rank, max_kv_len, num_sms, programs_per_sm or 1,
                            num_splits)
    block_m = 16 if exact else min(32, max(16, _pow2(num_heads)))
    auto = swap is None
    if auto:  # the measured winner: 16-bit latents at V2-Lite's 16 heads (docs/benchmarks.md)
        swap = not exact and cache_dtype not in FP8 and num_heads <= 16
        hoist = DEFAULT_HOIST_TOKENS // 32 if swap else 0
    swap = (not exact) and bool(swap)
    qfp8 = swap and cache_dtype == torch.float8_e4m3fn and bool(qfp8)
    prefetch = swap and bool(prefetch)
    hoist = int(hoist or 0) if swap and not prefetch else 0
    # (block_n, warps, stages, programs per SM) from the sm_90 compile of each variant
    # (benchmarks/kernels/inspect_mla.py). Rows kernel: 16-bit 32-token tiles take 104
    # registers and 56 KB of shared memory (2 per SM), 428 instructions per warp and tile; 8-bit
    # tiles read as 16-bit words and converted in registers (PAIRS) take 196 registers and 123
    # KB at 64 tokens (1 per SM). Swapped kernel: 64-token tiles (warp-group MMAs) take 123-193
    # KB (1 per SM), 32-token tiles 57-106 KB (2 per SM)
    if exact:
        tile = (16, 4, 1, 1)
    elif swap and hoist:
        # 32-token tiles, 4 warps, 4 stages (3 tiles in flight), 166 registers and 130 KB
        tile = (32, 4, 4, 1)
    elif swap:
        tile = (64, 8, 2, 1)
    elif cache_dtype in FP8:
        tile = (64, 8, 3, 1)
    else:
        tile = (32, 8, 2, 2)
    if swap and block_n is not None:
        tile = (block_n, tile[1], tile[2], 1 if block_n >= 64 else 2)
    if programs_per_sm is not None:
        tile = tile[:3] + (programs_per_sm,)
    cfg = MLAConfig(block_m, block_n or tile[0], num_warps or tile[1], num_stages or tile[2],
                    swap=swap, qfp8=qfp8, prefetch=prefetch, hoist=hoist)
    return _with_splits(cfg, batch, num_heads, rank, max_kv_len, num_sms, tile[3], num_splits)


def describe_decode(cfg: MLAConfig, cache_dtype: torch.dtype) -> str:
    """One phrase naming the decode kernel ``cfg`` runs (the engine's start-up log)."""
    if cfg.gluon:
        kind = ("A operand from registers" if cfg.regs else "pipelined, fp8 logits" if cfg.pipe
                else "fp8 logits" if cfg.qfp8 else "")
        return (f"the Gluon kernel (Hopper warp-group MMAs{', ' + kind if kind else ''}) over "
                f"{cache_dtype} latents")
    kind = "swapped (heads as N)" if cfg.swap else "row"
    return f"the Triton {kind} kernel over {cache_dtype} latents"


def _with_splits(cfg: MLAConfig, batch: int, num_heads: int, rank: int, max_kv_len: int,
                 num_sms: int, per_sm: int, num_splits: int | None) -> MLAConfig:
    """``cfg`` with its split count: the fewest waves per unit of work over ``num_sms`` SMs at
    ``per_sm`` programs each, splits of >= 256 tokens, 1% merge cost per split (one split for
    ranks that are not a power of two); ``num_splits`` given wins."""
    max_splits = int(min(64, max(1, math.ceil(max(1, max_kv_len) / 256))))
    if num_splits is None:
        num_splits = 1
        if rank == _pow2(rank):
            slots = num_sms * per_sm
            programs = max(1, batch * math.ceil(num_heads / cfg.block_m))
            best = (float("inf"), 1)
            for sp in range(1, max_splits + 1):
                cost = math.ceil(programs * sp / slots) / sp * (1 + 0.01 * sp)
                if cost < best[0] - 1e-12:
                    best = (cost, sp)
            num_splits = best[1]
    return dataclasses.replace(cfg, num_splits=num_splits)


def prefill_config(num_heads: int, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> MLAConfig:
    """Rows: 32 (token, head) pairs per program (16 for float32), 32-token latent tiles, 8
    warps, 3 stages: the sm_90 compile of 64-row programs spills (a [64, 512] float32
    accumulator and the [64, 576] query), 32 rows do not (199 registers for 16-bit latents, 254
    for fp8; benchmarks/kernels/inspect_mla.py)."""
    if _exact(q_dtype, cache_dtype):
        return MLAConfig(16, 16, 4, 1)
    return MLAConfig(32, 32, 8, 3)


def order_mla_blocks(q_lens, kv_lens, num_heads: int, block_m: int, device) -> torch.Tensor:
    """[NB, 2] int32 (request, first row) per prefill program, heaviest (longest visible
    context) first so the long blocks start in the first wave. Host work, one copy."""
    from kvfit.transfer import to_device

    work = []
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for r0 in range(0, ql * num_heads, block_m):
            last = min((r0 + block_m - 1) // num_heads, ql - 1)
            work.append((kl - ql + last, i, r0))
    work.sort(key=lambda w: -w[0])
    flat = [x for _, i, r0 in work for x in (i, r0)]
    return to_device(np.asarray(flat, dtype=np.int32).reshape(-1, 2), torch.device(device))


def _check(q, cache, out, rank: int):
    t, h, slab = q.shape
    if cache.dim() != 3 or cache.shape[2] != slab or cache.stride(2) != 1 or cache.stride(1) != slab:
        raise ValueError(f"MLA attention needs a contiguous latent cache [pages, P, {slab}], got "
                         f"{tuple(cache.shape)}")
    if out.shape != (t, h, rank) or out.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"MLA attention: q {tuple(q.shape)} and out {tuple(out.shape)} must be "
                         f"[T, H, {slab}] and [T, H, {rank}] with contiguous last dims")


def _launch(q, cache, block_table, cu_seqlens_q, kv_lens, blocks, out, op, lse, rank: int,
            sm_scale: float, scale: float, cfg: MLAConfig, grid0: int, decode: bool):
    h, slab = q.shape[1], q.shape[2]
    rope = slab - rank
    exact = _exact(q.dtype, cache.dtype)
    single = cfg.num_splits == 1
    kern = mla_kernels.build()[0]
    kern[(grid0, cfg.num_splits)](
        q, cache, block_table, cu_seqlens_q, kv_lens, blocks, out,
        out if single else op, out if single else lse,
        float(sm_scale * scale * LOG2E), float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        block_table.stride(0), cfg.num_splits,
        H=h, RANK=rank, ROPE=rope, DC=_pow2(rank), DR=max(16, _pow2(rope)), SLAB=slab,
        PAGE=cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HBLK=math.ceil(h / cfg.block_m), DECODE=decode, SINGLE=single,
        F16=cache.dtype in FP8 and not exact, PREC="ieee" if exact else "tf32",
        PAIRS=cache.dtype in FP8 and not exact and cfg.pairs and rank % 2 == 0,
        E5M2=cache.dtype == torch.float8_e5m2, ASM=not _interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_swap(q, cache, block_table, kv_lens, out, op, lse, rank: int, sm_scale: float,
                 scale: float, cfg: MLAConfig):
    """The swapped decode kernel (heads as N, ``mla_decode_kernels``), one query per request."""
    b, h, slab = q.shape
    if _exact(q.dtype, cache.dtype):
        raise ValueError("the swapped MLA decode runs 16-bit MMAs; float32 takes swap=False "
                         "(decode_config does)")
    single = cfg.num_splits == 1
    hblk = math.ceil(h / cfg.block_m)
    mla_decode_kernels.build()[(b * hblk, cfg.num_splits)](
        q, cache, block_table, kv_lens, out, out if single else op, out if single else lse,
        float(sm_scale * scale * LOG2E), float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        block_table.stride(0), cfg.num_splits,
        H=h, RANK=rank, ROPE=slab - rank, DC=_pow2(rank), DR=max(16, _pow2(slab - rank)),
        SLAB=slab, PAGE=cache.shape[1], BLOCK_H=cfg.block_m, BLOCK_N=cfg.block_n, HBLK=hblk,
        SINGLE=single, F16=cache.dtype in FP8,
        PAIRS=cache.dtype in FP8 and rank % 2 == 0,
        E5M2=cache.dtype == torch.float8_e5m2, ASM=not _interpreting(),
        QFP8=cfg.qfp8 and cache.dtype == torch.float8_e4m3fn and rank % 2 == 0,
        PREFETCH=cfg.prefetch, HOIST=cfg.hoist,
        MAXP_POW2=max(16, _pow2(cfg.hoist * cfg.block_n // cache.shape[1] + 2)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor, rank: int,
               sm_scale: float, cfg: MLAConfig, scale: float = 1.0,
               scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q ``[B, H, slab]`` (one token per request; ``cu_seqlens_q`` = 0..B) -> out ``[B, H,
    rank]`` (written). ``scratch`` = (op ``[>= B*H*S, rank]`` f32, lse ``[>= B*H*S]`` f32) lets
    CUDA-graph callers pass static buffers; otherwise allocated when ``cfg.num_splits > 1``."""
    _check(q, cache, out, rank)
    b, h, _ = q.shape
    if b == 0:
        return out
    s = cfg.num_splits
    op = lse = None
    if s > 1:
        if rank != _pow2(rank):
            raise ValueError(f"split MLA decode needs a power-of-two rank, got {rank}: use "
                             f"num_splits=1 (decode_config does)")
        if scratch is None:
            scratch = (torch.empty((b * h * s, rank), dtype=torch.float32, device=q.device),
                       torch.empty((b * h * s,), dtype=torch.float32, device=q.device))
        op, lse = scratch
    if not (cfg.gluon and mla_gluon.launch(q, cache, block_table, kv_lens, out, op, lse, rank,
                                           sm_scale * scale * LOG2E, scale, cfg)):
        if cfg.gluon:
            # this Triton cannot compile the Gluon kernel (logged once): the Triton kernels at
            # the same split count, so split scratch sized for cfg (CUDA graphs) stays right
            cfg = decode_config(b, h, rank, 0, cache.dtype, q.dtype, num_splits=s, gluon=False,
                                rope=q.shape[2] - rank)
        if cfg.swap:
            _launch_swap(q, cache, block_table, kv_lens, out, op, lse, rank, sm_scale, scale,
                         cfg)
        else:
            _launch(q, cache, block_table, cu_seqlens_q, kv_lens, kv_lens, out, op, lse, rank,
                    sm_scale, scale, cfg, b * math.ceil(h / cfg.block_m), True)
    if s > 1:
        # the merge holds all S_PAD x rank partials of a row: <= 128 float32 registers a thread
        warps = min(8, max(2, rank * _pow2(s) // 4096))
        decode_kernels.merge_splits(op, lse, out, float(scale), s, warps)
    return out


def mla_prefill(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, blocks: torch.Tensor,
                out: torch.Tensor, rank: int, sm_scale: float, cfg: MLAConfig,
                scale: float = 1.0) -> torch.Tensor:
    """q ``[T, H, slab]`` of a flat batch (``cu_seqlens_q``; request i's tokens at positions
    ``kv_lens[i] - q_len_i ..``) -> out ``[T, H, rank]`` (written) for the programs listed in
    ``blocks`` (``order_mla_blocks`` with ``cfg.block_m``), causal over each request's cache."""
    _check(q, cache, out, rank)
    if blocks.shape[0] == 0:
        return out
    if cfg.num_splits != 1:
        raise ValueError("mla_prefill runs one split per program")
    _launch(q, cache, block_table, cu_seqlens_q, kv_lens, blocks, out, None, None, rank,
            sm_scale, scale, cfg, blocks.shape[0], False)
    return out


def store_latent(kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, fmt,
                 scale: float = 1.0) -> None:
    """kv ``[T, slab]`` -> cache ``[num_pages, P, slab]`` at ``slot_mapping`` (slots < 0
    skipped), ``cast(clamp(x / scale))`` as ``kvcache.quant.quantize``. Mutates ``cache``."""
    import triton

    t, slab = kv.shape
    if t == 0:
        return
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if cache.shape[2] != slab or cache.stride(2) != 1 or cache.stride(1) != slab:
        raise ValueError(f"store_latent needs a contiguous cache [pages, P, {slab}], got "
                         f"{tuple(cache.shape)}")
    quant = bool(fmt.quantized)
    inv = float(np.float32(1.0) / np.float32(scale))
    block = triton.next_power_of_2(slab)
    mla_kernels.build()[1][(t,)](kv, cache, slot_mapping, inv,
                                 float(fmt.max_finite) if quant else 0.0, kv.stride(0),
                                 cache.stride(0), SLAB=slab, PAGE=cache.shape[1], BLOCK=block,
                                 QUANT=quant, SCALED=scale != 1.0,
                                 num_warps=4 if block >= 512 else 1)
