"""Paged decode attention over the int4 pool (Triton), host side: launch choice and launch.

One query token per request. Program (b, h, s) (kernel in ``decode_int4_kernels``) loads the G
query heads that share KV head h as their even and odd channel halves (padded to 16 rows for
``tl.dot``), walks split s of request b's full pages ``pages_per_tile`` pages per loop
iteration (software-pipelined over ``num_stages``), then, in the last split, the request's
full-precision residual page (``kv_len % 32`` tokens), with an online softmax in float32
(base-2 logits). Per tile, in registers:

* K and V codes: a byte's low nibble is an even channel, its high nibble the odd one; they
  become float16 ``code * scale + zero`` by inline asm (kernels/nibbles.py: no int->float
  conversion instruction on the GPU), so the logits are ``q_even . K_even + q_odd . K_odd``;
* K is read as K^T ``[D/2, pages, tokens]`` and dequantized into the MMA's B operand, its
  per-channel scale and zero (stored even channels first) loaded once per page (or per token
  with ``ks_tokens``), or folded into the query (``fold_k``: one page a step,
  (q*s) . codes + q . zero);
* V ``[pages, tokens, D/32, 16]`` with its per-token, per-32-channel scale/zero broadcast, the
  even/odd halves joined back to channel order for one P@V.

``Int4DecodeConfig.gluon`` runs a Gluon kernel instead (Hopper, 16-bit queries and residual):
over token-major V pages ``decode_int4_gluon`` (each tile's nibbles converted once into shared
memory, warp-group MMAs), over token-minor ones (the pool's ``v_layout`` "HDN")
``decode_int4_regs_kernel`` (both MMA operands converted straight into registers; launch per
head size ``REGS_TILES``, default per GPU ``REGS_DEFAULT_ON``); a Triton that cannot compile
one is logged once and the Triton kernel runs.

Float32 queries take the exact path (float32 values, IEEE products). Split-K as the fp8 decode:
with more than one split the decode merge kernel (``decode_kernels``) combines the partial
outputs by their base-2 log-sum-exp. The grid depends only on (batch, kv heads, splits): no host
syncs, CUDA-graph capturable. Owns nothing; writes ``out`` (and the split scratch).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from kvfit.kernels.decode_int4_kernels import build
from kvfit.kernels.gluon_hopper import launch_or_record

LOG2E = 1.4426950408889634
PAGE = 32  # the int4 pool's page = K's quantization group
# the triton backend's int4 decode on Hopper with 16-bit compute: the Gluon kernel
# (decode_int4_gluon), measured 1.2-2.0x the Triton kernel on the H200 and 1.45-2.3x on an H100
# (docs/benchmarks.md)
GLUON = True
# the Gluon kernel's launch per head size: (stages, programs per SM in the split rule, register
# cap), the fastest of the H200 sweep (2026-12-03) and, for 256-d, of the H100 sweep of the
# kernel that dequantizes K (2026-12-06: 2 programs an SM, 1.19x the 1-an-SM launch); sm_90
# compile: 128-d 128 registers, 53 KB of shared memory, so 4 programs an SM; 64-d 112 / 27 KB;
# 256-d 168 / 105 KB, two an SM
GLUON_TILES = {64: (2, 3, 128), 128: (2, 4, 128), 256: (2, 2, 168)}
# the register kernel's tile maximum exchanged through shared memory with one barrier
# (gluon_hopper._tile_max, as decode_8bit_gluon.EXCHANGE_MAX): the same maximum, so the same
# output (tests/gpu/test_int4_decode.py, passed on an H100); timed off and on in one call
# (reproduce.sh exchange, H100, 2026-12-06): 1-5% faster at every shape, the int4/fp8 ratio
# 1.35-1.64x -> 1.35-1.67x and 256-d 1.16x -> 1.22x (docs/benchmarks.md, twenty-fourth session)
EXCHANGE_MAX = True
# the register int4 kernel (decode_int4_regs_kernel, token-minor V pages) per head size:
# (programs per SM in the split rule, register cap, K's scales loaded a tile ahead), the fastest
# of the H200 sweep (2026-12-06, docs/benchmarks.md); sm_90 compile (Triton 3.6): 64-d 96
# registers (5 an SM), 128-d 128 with K's scales loaded at their tile (4 an SM, no spills;
# loaded ahead: 160, 3 an SM), 256-d 255 (2 an SM)
REGS_TILES = {64: (5, 96, False), 128: (4, 128, False), 256: (2, None, True)}
# the register kernel per head size: how many tiles ahead each tile's lines are asked of L2
# (``prefetch.global.L2``, one line a thread, no registers held for it; 0: none), so that a
# tile's loads, issued late in the tile before by ptxas, wait for L2 instead of DRAM (ncu, H100:
# 43% of the stalls are long-scoreboard waits on those loads and on K's scales loaded at their
# tile). sm_90 compile (Triton 3.6): 128-d 446 instructions a tile against 440, 128 registers, no
# spills; 64-d 290 / 287; 256-d 784 / 750. Off until timed on a GPU (reproduce.sh int4-l2)
REGS_L2_AHEAD = {64: 0, 128: 0, 256: 0}
# per GPU (a substring of its CUDA device name): the head sizes whose int4 pools store
# token-minor V and decode with the register kernel by default (the triton backend's choice,
# ``regs_default``): measured 1.2-1.6x the shared-memory Gluon kernel at 64/128/256-d on the
# H100 and the H200 (docs/benchmarks.md, 2026-12-06)
REGS_DEFAULT_ON: dict = {"H100": frozenset({64, 128, 256}), "H200": frozenset({64, 128, 256})}
_gluon_failures: list[str] = []  # the first compile failure of the Gluon kernel, if any


@dataclass(frozen=True)
class Int4DecodeConfig:
    """Launch choices of one int4 decode call (fixed per CUDA-graph batch size)."""

    num_splits: int
    pages_per_tile: int = 2  # NPG: pages (of 32 tokens) per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True  # 16-bit queries: nibbles -> float16 by inline asm (False: casts)
    maxnreg: int | None = None  # register cap per thread (more programs per SM)
    # one page a step with K's scale folded into the query (q*s) . codes + q . zero, codes as
    # exact float16 0..15 (no scale/zero per element); pages_per_tile is then 1
    fold_k: bool = False
    # K's scale/zero loaded once per token of the tile (redundant addresses: the loads then take
    # the codes' register layout) instead of once per page (one value per thread)
    ks_tokens: bool = False
    # the Gluon kernel (decode_int4_gluon: two pages a tile, 4 warps, num_stages copies in
    # flight, maxnreg; 16-bit queries and residual, sm_90; over token-minor V pages the
    # register kernel, decode_int4_regs_kernel); the other tile fields do not apply
    gluon: bool = False
    # the register kernel: K's scales and zeros loaded a tile ahead with the codes (more
    # registers carried) instead of at their tile
    ks_ahead: bool = False
    # the register kernel: each tile's lines asked of L2 this many tiles ahead (0: none)
    l2_ahead: int = 0


# per head size: (pages per tile, warps, stages, register cap, programs per SM in the split
# rule, asm conversion): the fastest row of each head size in the H200 sweep of 2026-12-01
# 08:18 UTC (docs/benchmarks.md; at 64 and 256 the cast conversion measured faster than asm)
TILES = {64: (2, 4, 3, None, 2, False), 128: (2, 4, 3, None, 2, True),
         256: (2, 4, 2, None, 2, False)}


def gluon_available(device=None) -> bool:
    """The Gluon kernel can run here: a Hopper GPU with Gluon's Hopper module, no compile
    failure in this process (``gluon_hopper.gluon_available`` decides the first two)."""
    from kvfit.kernels.gluon_hopper import gluon_available as hopper_gluon

    if _gluon_failures or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    return hopper_gluon(index)


@functools.lru_cache(maxsize=1024)
def choose_config(batch: int, num_kv_heads: int, head_dim: int, max_kv_len: int,
                  num_sms: int = 132, pages_per_tile: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  ctas_per_sm: int | None = None, gluon: bool = False,
                  v_t: bool = False) -> Int4DecodeConfig:
    """Tile and a wave-aware split count: ``batch * kv_heads * splits`` programs on
    ``num_sms * ctas_per_sm`` slots, the split count minimising waves per unit of work with
    splits of >= 4 tiles and a 1%-per-split merge cost (as the fp8 decode's rule). An explicit
    tile (pages, warps, stages) runs without the register cap of the measured default.
    ``gluon``: the Gluon kernel's launch (two pages a tile, 4 warps, ``GLUON_TILES``); the
    caller decides whether it can run (``gluon_available``, 16-bit queries); with ``v_t``
    (token-minor V pages) the register kernel's (``REGS_TILES``)."""
    npg, warps, stages, maxnreg, per_sm, asm = TILES.get(head_dim, TILES[256])
    ks_ahead, l2_ahead = False, 0
    if gluon and v_t:
        per_sm, maxnreg, ks_ahead = REGS_TILES.get(head_dim, REGS_TILES[256])
        l2_ahead = REGS_L2_AHEAD.get(head_dim, 0)
        npg, warps, stages = 2, 4, 1
    elif gluon:
        stages, per_sm, maxnreg = GLUON_TILES.get(head_dim, GLUON_TILES[256])
        npg, warps, stages = 2, 4, num_stages or stages
    elif (pages_per_tile, num_warps, num_stages) != (None, None, None):
        npg, warps, stages = pages_per_tile or npg, num_warps or warps, num_stages or stages
        maxnreg, per_sm = None, 2
    per_sm = ctas_per_sm or per_sm
    programs = max(1, batch * num_kv_heads)
    tile = npg * PAGE
    max_splits = int(min(64, max(1, math.ceil(max(1, max_kv_len) / (4 * tile)))))
    slots = num_sms * per_sm
    best = (float("inf"), 1)
    for sp in range(1, max_splits + 1):
        cost = math.ceil(programs * sp / slots) / sp * (1 + 0.01 * sp)
        if cost < best[0] - 1e-12:
            best = (cost, sp)
    return Int4DecodeConfig(best[1], npg, warps, stages, asm, maxnreg, gluon=gluon,
                            ks_ahead=ks_ahead, l2_ahead=l2_ahead)


def _launch(q, pool, layer_id, block_table, kv_lens, residual_slots, out, op, lse,
            sm_scale: float, cfg: Int4DecodeConfig):
    """(jitted kernel, grid, positional args, launch options) of one decode call."""
    import triton

    b, hq, d = q.shape
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    kr, vr = pool.k_residual[layer_id], pool.v_residual[layer_id]
    hkv = kc.shape[1]
    group = hq // hkv
    v_t = pool.v_layout == "HDN"  # token-minor V pages (kvcache/int4_pool.py)
    if v_t and cfg.fold_k:
        raise ValueError("fold_k reads token-major V pages: the pool stores token-minor V "
                         "(v_layout 'HDN'); use fold_k=False")
    # float16 products for 16-bit queries (as the fp8 kernels: 11-bit mantissa, K up to ~220 in
    # real models is far inside its range); exact float32 when the query or residual is float32
    f32 = torch.float32 in (q.dtype, kr.dtype)
    args = (q, out, op, lse, kc, vc, ks, kz, vs, vz, kr, vr, block_table, kv_lens,
            residual_slots, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
            kr.stride(0), kr.stride(1), block_table.stride(0), sm_scale * LOG2E,
            cfg.num_splits)
    if cfg.gluon:
        if f32 or q.dtype != kr.dtype:
            raise ValueError(f"the Gluon int4 decode takes 16-bit queries and residual of one "
                             f"dtype, got {q.dtype} / {kr.dtype}: use gluon=False")
        if v_t:
            return _launch_regs(args, b, hkv, group, d, cfg)
        from kvfit.kernels import decode_int4_gluon

        opts = dict(G=group, BLOCK_H=max(8, triton.next_power_of_2(group)), D=d,
                    PAGE=pool.page_size, STAGES=cfg.num_stages, SINGLE=cfg.num_splits == 1,
                    num_warps=4)
        if cfg.maxnreg:
            opts["maxnreg"] = cfg.maxnreg
        return decode_int4_gluon.build(), (b, hkv, cfg.num_splits), args, opts
    opts = dict(G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d,
                PAGE=pool.page_size, NPG=1 if cfg.fold_k else cfg.pages_per_tile, F32=f32,
                ASM=cfg.asm and not f32, KFOLD=cfg.fold_k, KS_TOKENS=cfg.ks_tokens,
                SINGLE=cfg.num_splits == 1, V_T=v_t, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return build(), (b, hkv, cfg.num_splits), args, opts


def regs_default(head_dim: int, device_name: str) -> bool:
    """Whether ``REGS_DEFAULT_ON`` lists ``head_dim`` for the GPU named ``device_name``."""
    return any(gpu in device_name and head_dim in dims for gpu, dims in REGS_DEFAULT_ON.items())


def regs_default_here(head_dim: int) -> bool:
    """Whether an int4 pool on this process's GPU stores token-minor V for the register kernel
    by default: a Hopper GPU that ``REGS_DEFAULT_ON`` lists for this head size (the triton
    backend's ``v_layout``)."""
    if not GLUON or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device()
    return regs_default(head_dim, torch.cuda.get_device_name(index)) and gluon_available(index)


def _launch_regs(args, b: int, hkv: int, group: int, d: int, cfg: Int4DecodeConfig):
    """(kernel, grid, args, options) of the register kernel over token-minor V pages."""
    import triton

    from kvfit.kernels import decode_int4_regs_kernel
    from kvfit.kernels.decode_int4_regs_layouts import layouts

    if d not in REGS_TILES:
        raise ValueError(f"the register int4 decode takes head_dim {sorted(REGS_TILES)}, got "
                         f"{d}: use gluon=False")
    bh = max(8, triton.next_power_of_2(group))
    mma, lk, lk4, lks, lv4, lvs, lak, lav = layouts(d, bh)
    opts = dict(G=group, BLOCK_H=bh, D=d, PAGE=PAGE, SINGLE=cfg.num_splits == 1, MMA=mma, LK=lk,
                LK4=lk4, LKS=lks, LV4=lv4, LVS=lvs, LAK=lak, LAV=lav, KS_AHEAD=cfg.ks_ahead,
                XMAX=EXCHANGE_MAX, L2_AHEAD=cfg.l2_ahead, num_warps=4)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return decode_int4_regs_kernel.build(), (b, hkv, cfg.num_splits), args, opts


def int4_decode(q: torch.Tensor, pool, layer_id: int, block_table: torch.Tensor,
                kv_lens: torch.Tensor, residual_slots: torch.Tensor, out: torch.Tensor,
                sm_scale: float, cfg: Int4DecodeConfig | None = None,
                scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` over layer ``layer_id`` of an ``Int4KVCache`` -> ``out [B, Hq, D]``.

    ``block_table [B, max_pages]`` int32, ``kv_lens [B]`` int32 (tokens cached, including the
    residual's), ``residual_slots [B]`` int32 (each request's slot), ``cfg`` the launch
    (``choose_config``; default: chosen here from ``kv_lens``' bound, the block table's width).
    ``scratch`` = (op ``[>= B*Hq*S, D]`` f32, lse ``[>= B*Hq*S]`` f32): static split buffers for
    CUDA-graph callers (else allocated here). Writes ``out``.
    """
    b, hq, d = q.shape
    if pool.page_size != PAGE:
        raise ValueError(f"int4_decode reads pages of {PAGE} tokens, the pool has "
                         f"{pool.page_size}")
    if cfg is None:
        cfg = choose_config(b, pool.k_caches[layer_id].shape[1], d,
                            block_table.shape[1] * PAGE, v_t=pool.v_layout == "HDN")
    single = cfg.num_splits == 1
    if single:
        op = lse = out  # unused
    elif scratch is not None:
        n = b * hq * cfg.num_splits
        op, lse = scratch[0][:n], scratch[1][:n]
    else:
        op = torch.empty((b * hq * cfg.num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b * hq * cfg.num_splits,), dtype=torch.float32, device=q.device)
    if cfg.gluon and _gluon_failures:
        cfg = dataclasses.replace(cfg, gluon=False)
    kern, grid, args, opts = _launch(q, pool, layer_id, block_table, kv_lens, residual_slots,
                                     out, op, lse, sm_scale, cfg)
    if not cfg.gluon:
        kern[grid](*args, **opts)
    elif not launch_or_record(lambda: kern[grid](*args, **opts), _gluon_failures,
                              "Gluon int4 decode kernel", "int4 decode runs the Triton kernel "
                              "(slower on Hopper: docs/benchmarks.md)"):
        kern, grid, args, opts = _launch(q, pool, layer_id, block_table, kv_lens, residual_slots,
                                         out, op, lse, sm_scale,
                                         dataclasses.replace(cfg, gluon=False))
        kern[grid](*args, **opts)
    if not single:
        from kvfit.kernels.decode_kernels import merge_splits

        # every int4 split writes its partial (an empty one lse -inf): no live count
        merge_splits(op, lse, out, 1.0, cfg.num_splits, 4 if d >= 128 else 2)
    return out
