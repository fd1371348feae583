"""Paged split-K decode attention (Triton), GQA-aware, dequantizing KV pages in registers: host side.

One query token per request. ``paged_decode`` launches program (b, h, s) per request, KV head
and split of the context (kernels in ``decode_kernels``); with more than one split a second small
kernel merges the partial results by their log-sum-exp. ``choose_config`` picks the tile, the
pipeline depth and the split count (wave-aware, from the measured occupancy of each variant).

The launch grid depends only on (batch, kv heads, splits): no host syncs, CUDA-graph capturable.
Owns nothing; writes ``out`` (and scratch ``op``/``lse`` when splitting).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from kvfit.kernels import decode_8bit_gluon, decode_kernels
from kvfit.kernels.pdl import launch_options

LOG2E = 1.4426950408889634
# page dtypes whose 64-d decode runs packed (kernels/decode_packed.py) by default: measured
# faster on the H200 for these (docs/kernels.md); empty = the plain tile everywhere
PACKED_DTYPES: tuple = ()
# DecodeConfig.i8_cvt -> the kernels' (K_CVT, I8_CVT): K's and V's int8 tile handling. 0 Triton's
# cast, 1 four values per inline-asm prmt/sub, 2 the same without the subtraction (+1152,
# corrected per tile), 3 (K only) no conversion: two int8 MMAs of q split as hi + lo / 254
# (one factor per query row), 4 the same with one factor for the whole query group
I8_CVTS = {"cast": (0, 0), "asm": (1, 1), "bias": (2, 2), "kbias": (2, 1), "imma": (3, 1),
           "imma-bias": (3, 2), "imma1": (4, 1)}
# 8-bit page dtypes: converted to float16 tiles for the MMAs (exact for int8)
EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# DecodeConfig.min_split_tokens of choose_config. At batch 1 a graph captured for 16k+ contexts
# runs 64 splits, so a 1k context runs 16 one-tile splits (the rest empty: they exit at once
# and the merge skips them). A floor of 64/128/256 tokens per split measured equal or slower
# on the H200 (1k: 6.9 / 7.4 / 9.3 us per layer against 6.9 with none; docs/benchmarks.md
# "Decode splits at short contexts"): none by default, kept as a measured option.
MIN_SPLIT_TOKENS = 0
# DecodeConfig.fused_merge of choose_config: split launches merge in their last program (one
# launch a layer instead of two). Correct on the H200 and slower there (batch 1: 0.97x the
# merge kernel's tok/s at 1k and 16k; docs/benchmarks.md "The split merge fused into the split
# kernel"): off, kept as a measured option; the CPU interpreter and GPU tests run it.
FUSED_MERGE = False


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices for one decode call (fixed per CUDA-graph batch size)."""

    num_splits: int
    block_n: int
    use_dot: bool  # tensor-core tl.dot (query group padded to 16 rows) or the CUDA-core path
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # register cap per thread (more programs per SM)
    v_t: bool = False  # V pages are token-minor [H, D, P] (pool v_layout "HDN")
    # int8 tiles -> float16: "asm" (four per inline-asm prmt/sub, GPU), "bias" (the same without
    # the subtraction: 1152 * sum(q) and 1152 * sum(P) corrected per tile) or "cast" (I2F each);
    # "kbias" (K biased, V asm); "imma" / "imma-bias" (K unconverted: int8 MMAs with q split
    # into two int8 terms, exact int32 sums; V asm / biased); "imma1" (as imma, one q scale
    # for the query group, folded into the key scales). I8_CVTS has the codes.
    i8_cvt: str = "asm"
    # > 1: R sub-splits packed into the 16 MMA rows (kernels/decode_packed.py; HND, G <= 16/R)
    pack: int = 1
    # > 1: that many KV heads per program, one [16, heads * D] tile (kernels/decode_heads.py;
    # a power of two with heads * G <= 16)
    heads: int = 1
    # the fewest tokens a split holds (rounded up to block_n): a CUDA graph's split count
    # comes from the longest context it may see, and a shorter one then fills fewer splits
    min_split_tokens: int = 0
    # the last split of each (request, KV head) to finish merges the partials in the split
    # kernel (an atomic count per (request, KV head)), no merge launch; the main split kernel
    # only (not pack/heads/CUDA-core)
    fused_merge: bool = False
    # the Gluon kernel (kernels/decode_8bit_gluon.py: 8-bit pages over token-minor V, 64-token
    # tiles, warp-group MMAs with operands from registers; Hopper, 16-bit queries, no window or
    # soft-cap); maxnreg and num_splits apply, the other tile fields not
    gluon: bool = False


@functools.lru_cache(maxsize=1024)  # a pure function of hashable arguments, called every step
def choose_config(batch: int, num_kv_heads: int, group: int, head_dim: int, max_kv_len: int,
                  cache_dtype: torch.dtype, q_dtype: torch.dtype, num_sms: int = 132,
                  use_dot: bool | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  maxnreg: int | None = None, ctas_per_sm: int | None = None,
                  v_t: bool = False, page_size: int | None = None,
                  heads: int | None = None, gluon: bool = False) -> DecodeConfig:
    """Tile, pipeline depth and a wave-aware split count per dtype/layout (docs/kernels.md).

    ``batch * kv_heads * splits`` programs run ``ctas_per_sm`` at a time per SM (from each
    variant's compiled registers and shared memory, measured on the H200), so the split count
    minimises the number of waves per unit of work, ceil(programs / slots) / splits, with splits
    of >= 256 tokens and a 1%-per-split merge cost; e.g. 64 programs on 264 slots take 4 splits
    (one full wave), not 5. 16-bit 64-d HND tiles keep the earlier rule (~4 programs per SM).
    fp8 over token-minor V: 64-token tiles, 5 pipeline stages (two tiles in flight) and a
    128-register cap, i.e. 4 programs per SM (2.9-3.05 TB/s against 2.5-2.7 for the HND tile).

    8-bit pages over token-minor V (measured on the H200, docs/kernels.md "8-bit decode at fp8
    speed"): 256-d heads 64-token tiles, 3 stages, no register cap (3.53 TB/s fp8, 3.57 int8,
    against 2.43 for 32-token tiles); 64-d heads read all the KV heads whose query rows fit the
    16 MMA rows in one program (``heads``, kernels/decode_heads.py; 4 for groups of 3-4), 64-token
    tiles, 3 stages, a 168-register cap (3 programs per SM): 3.34-3.43 TB/s fp8 against 2.68 for
    the HND tile (tiles of at most 256 columns, as measured). int8 keys go through int8 MMAs
    (``i8_cvt`` "imma1"), except on HND 64-d tiles ("bias"). ``heads`` None: that choice; 1
    turns it off. ``gluon``: the Gluon kernel's launch (``decode_8bit_gluon.GLUON_TILES``; the
    caller decides whether it can run: ``decode_8bit_gluon.fits`` and ``available``).
    """
    fp8 = cache_dtype in EIGHT_BIT  # int8 pages take the fp8 tiles (same bytes per element)
    if use_dot is None:
        use_dot = q_dtype in (torch.bfloat16, torch.float16) and cache_dtype != torch.float32
    small = head_dim <= 128
    if gluon:
        if not (fp8 and v_t and use_dot):
            raise ValueError(f"the Gluon decode reads 8-bit pages over token-minor V with 16-bit "
                             f"queries, got {cache_dtype} pages, v_t={v_t}, {q_dtype} queries: "
                             f"use gluon=False")
        per_sm, nreg = decode_8bit_gluon.GLUON_TILES.get(head_dim,
                                                         decode_8bit_gluon.GLUON_TILES[256])
        if block_n not in (None, 64):
            raise ValueError(f"the Gluon decode's tiles hold 64 tokens, not block_n={block_n}: "
                             f"leave block_n unset")
        tile, heads = (64, 1, nreg, per_sm), 1  # (no software pipeline stages: 1)
    elif not use_dot:
        tile = (16, 2, None, 4)  # block_n, num_stages, maxnreg, ctas_per_sm
    elif fp8 and v_t:
        if head_dim <= 64:
            tile = (64, 3, 168, 3)
        else:
            tile = (64, 5, 128, 4) if small else (64, 3, None, 2)
    elif fp8:
        tile = (128 if small else 64, 3, None, 4 if head_dim <= 64 else 2)
    else:
        tile = (64 if small else 32, 3, None, 4 if small else 2)
    block_n = block_n or tile[0]
    num_stages = num_stages or tile[1]
    maxnreg = maxnreg if maxnreg is not None else tile[2]
    ctas_per_sm = ctas_per_sm or tile[3]
    if heads is None:
        heads = 1
        if use_dot and fp8 and v_t and head_dim <= 64:  # as many KV heads as the rows allow
            while (heads * 2 * group <= 16 and heads * 2 * head_dim <= 256
                   and heads < num_kv_heads):
                heads *= 2
    programs = max(1, batch * -(-num_kv_heads // heads))  # heads: KV heads per program
    max_splits = int(min(64, max(1, math.ceil(max(1, max_kv_len) / 256))))
    if use_dot and not fp8 and head_dim <= 64 and not v_t:
        # 16-bit 64-d tiles: measured best with ~4 programs per SM of splits (v2 rule); the
        # wave model picked more splits here and lost 5-18% (docs/kernels.md)
        splits = min(max_splits, max(1, math.ceil(4 * num_sms / programs)))
    else:
        slots = num_sms * ctas_per_sm
        best = (float("inf"), 1)
        for sp in range(1, max_splits + 1):
            cost = math.ceil(programs * sp / slots) / sp * (1 + 0.01 * sp)
            if cost < best[0] - 1e-12:
                best = (cost, sp)
        splits = best[1]
    pack = 1
    if (PACKED_DTYPES and cache_dtype in PACKED_DTYPES and use_dot and not v_t
            and head_dim <= 64 and group <= 4 and block_n % 64 == 0
            and (page_size is None or page_size % 4 == 0)):
        pack = 16 // max(4, 1 << (group - 1).bit_length())  # 4 sub-splits (groups of 3-4)
    # int8 tiles: keys through int8 MMAs, one q factor per group, values by the subtracting
    # asm (1.13x fp8's time on 128-d heads against 1.24x for "asm", docs/kernels.md); the
    # biased conversion on HND 64-d tiles (imma measured 1.47x fp8 there, "bias" 1.37x)
    i8_cvt = "bias" if head_dim <= 64 and not v_t else "imma1"
    return DecodeConfig(splits, block_n, use_dot, num_warps or 4, num_stages, maxnreg or None,
                        v_t, i8_cvt=i8_cvt, pack=pack, heads=heads,
                        min_split_tokens=0 if gluon else MIN_SPLIT_TOKENS,
                        fused_merge=FUSED_MERGE and not gluon, gluon=gluon)


def _min_per(cfg: DecodeConfig) -> int:
    """The fewest tokens of a split, in whole tiles."""
    return -(-cfg.min_split_tokens // cfg.block_n) * cfg.block_n


def fuses_merge(cfg: DecodeConfig) -> bool:
    """True when a launch of ``cfg`` merges its splits inside the split kernel."""
    return (cfg.fused_merge and cfg.num_splits > 1 and cfg.use_dot and cfg.pack == 1
            and cfg.heads == 1)


def _split_launch(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, sm_scale: float,
                  cfg: DecodeConfig, k_scale: float, v_scale: float, softcap: float | None,
                  window: int | None, scale_caches=None, q_bias=None, counters=None):
    """(jitted split kernel, grid, positional args, launch options) of one decode call.
    ``counters``: int32 ``[>= B * Hkv]``, zero, for a fused merge (``fuses_merge``)."""
    import triton

    split_k, _, split_fma = decode_kernels.build()
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if cfg.pack > 1:
        _check_pack(cfg, group, k_cache.shape[2])
    if cfg.heads > 1:
        _check_heads(cfg, group, d)
    g_pad = max(triton.next_power_of_2(group), 16 if cfg.use_dot else 1)
    s = cfg.num_splits
    ks, vs, ssp, ssh = scale_cache_args(k_cache, scale_caches)
    rows = k_cache.dtype == torch.int8
    if rows:
        k_scale = v_scale = 1.0  # the per-token scales replace the per-tensor ones
    qb = _checked_bias(q_bias, q, k_scale, softcap)
    args = (q, k_cache, v_cache, ks, vs, q if qb is None else qb, block_table, kv_lens, out, op,
            lse, float(sm_scale * k_scale * LOG2E), float(softcap or 0.0), int(window or 0),
            float(v_scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), ssp, ssh, block_table.stride(0),
            0 if qb is None else qb.stride(0), s, _min_per(cfg))
    opts = dict(G=group, G_PAD=g_pad, D=d, PAGE=k_cache.shape[2], BLOCK_N=cfg.block_n,
                V_T=cfg.v_t, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
                SINGLE=s == 1, ROWS=rows, HAS_QBIAS=qb is not None, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **launch_options(q.device))
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    if cfg.use_dot:
        opts["F16"] = k_cache.dtype in EIGHT_BIT
        if cfg.i8_cvt not in I8_CVTS:
            raise ValueError(f"unknown int8 decode conversion {cfg.i8_cvt!r}; one of "
                             f"{', '.join(I8_CVTS)}")
        k_cvt, v_cvt = I8_CVTS[cfg.i8_cvt] if rows else (0, 0)
        opts["I8_CVT"] = v_cvt
        if cfg.pack > 1:
            if k_cvt != v_cvt:
                raise ValueError(f"the packed decode converts K and V alike: i8_cvt "
                                 f"{cfg.i8_cvt!r} does not apply (asm, bias or cast)")
            from kvfit.kernels import decode_packed

            del opts["G_PAD"], opts["V_T"]
            opts.update(GP=16 // cfg.pack, R=cfg.pack)
            return decode_packed.build(), (b, hkv, s), args, opts
        opts["K_CVT"] = k_cvt
        if cfg.heads > 1:
            from kvfit.kernels import decode_heads

            del opts["G_PAD"]
            opts.update(HP=cfg.heads, HKV=hkv)
            return decode_heads.build(), (b, triton.cdiv(hkv, cfg.heads), s), args, opts
        if fuses_merge(cfg):  # counters: _scratch's, zero and large enough
            opts.update(FUSED=True, S_PAD=triton.next_power_of_2(s))
            return split_k, (b, hkv, s), args + (counters,), opts
        return split_k, (b, hkv, s), args + (kv_lens,), opts
    return split_fma, (b, hkv, s), args, opts


def _checked_bias(q_bias, q: torch.Tensor, k_scale: float, softcap):
    """``q_bias`` ``[T, Hq]`` float32 (q . k_mean: what a centered K cache takes off every
    logit of a row), divided by the per-tensor K scale (the kernels add it to the raw q . k of
    the stored keys); None unless soft-capping makes it matter."""
    if q_bias is None or softcap is None:
        return None
    if tuple(q_bias.shape) != tuple(q.shape[:2]) or q_bias.dtype != torch.float32:
        raise ValueError(f"q_bias must be float32 {tuple(q.shape[:2])}, got {q_bias.dtype} "
                         f"{tuple(q_bias.shape)}")
    qb = q_bias if k_scale == 1.0 else q_bias / k_scale
    return qb if qb.stride(1) == 1 else qb.contiguous()


def _check_pack(cfg: DecodeConfig, group: int, page_size: int) -> None:
    """A packed launch needs the tensor-core path, HND V pages, the query group within 16/R rows,
    R consecutive tokens within a page, and >= 16 tile rows."""
    r = cfg.pack
    if (not cfg.use_dot or cfg.v_t or 16 % r or group > 16 // r or page_size % r
            or cfg.block_n % r or cfg.block_n // r < 16):
        raise ValueError(f"decode pack={r} does not fit this launch (use_dot={cfg.use_dot}, "
                         f"v_t={cfg.v_t}, group {group}, page size {page_size}, block_n "
                         f"{cfg.block_n}); use pack=1")


def _check_heads(cfg: DecodeConfig, group: int, head_dim: int) -> None:
    """A multi-head launch needs the tensor-core path, a power-of-two head count whose query
    rows fit the 16 MMA rows, a tile of at most 512 columns (heads x head_dim: wider tiles
    measured out of shared memory on the H200) and no sub-split packing."""
    hp = cfg.heads
    if (not cfg.use_dot or cfg.pack > 1 or hp & (hp - 1) or hp * group > 16
            or hp * head_dim > 512):
        raise ValueError(f"decode heads={hp} does not fit this launch (use_dot={cfg.use_dot}, "
                         f"pack={cfg.pack}, group {group}, head_dim {head_dim}: heads must be a "
                         f"power of two with heads x group <= 16 and heads x head_dim <= 512); "
                         f"use heads=1")


def scale_cache_args(k_cache: torch.Tensor, scale_caches):
    """(KS, VS, page stride, head stride) of the int8 scale caches ``[pages, Hkv, P]`` float16
    (tokens contiguous; views into a larger buffer allowed, K's and V's strides equal); the K
    cache as an unused placeholder for other dtypes."""
    if k_cache.dtype != torch.int8:
        return k_cache, k_cache, 0, 0
    if scale_caches is None:
        raise ValueError("int8 KV pages need their scale caches (k_scale_cache, v_scale_cache: "
                         "float16 [pages, kv heads, page size])")
    ks, vs = scale_caches
    want = tuple(k_cache.shape[:3])
    for sc in (ks, vs):
        if (tuple(sc.shape) != want or sc.dtype != torch.float16 or sc.stride(2) != 1
                or sc.stride() != ks.stride()):
            raise ValueError(f"int8 scale caches must be float16 {want} with the tokens "
                             f"contiguous and the same strides for K and V, got {sc.dtype} "
                             f"{tuple(sc.shape)} strides {sc.stride()}")
    return ks, vs, ks.stride(0), ks.stride(1)


def split_scratch(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  cfg: DecodeConfig, device) -> tuple:
    """Split scratch for ``paged_decode`` calls of ``cfg``, as its ``scratch`` argument takes it:
    (op, lse, counts), counts zero int32 for a fused merge (which leaves them zero), else None.
    Static for repeated calls (CUDA graphs, benchmarks)."""
    rows = batch * num_q_heads * max(1, cfg.num_splits)
    counts = (torch.zeros((batch * num_kv_heads,), dtype=torch.int32, device=device)
              if fuses_merge(cfg) else None)
    return (torch.empty((rows, head_dim), dtype=torch.float32, device=device),
            torch.empty((rows,), dtype=torch.float32, device=device), counts)


def _scratch(q, k_cache, cfg: DecodeConfig, scratch):
    """(op, lse, counts) of a split launch, (None, None, None) without splits: the caller's
    scratch, else allocated; a fused merge's counts allocated when the caller has none large
    enough."""
    b, hq, d = q.shape
    if cfg.num_splits == 1:
        return None, None, None
    if scratch is None:
        return split_scratch(b, hq, k_cache.shape[1], d, cfg, q.device)
    counts = scratch[2] if len(scratch) > 2 else None
    if fuses_merge(cfg) and (counts is None or counts.numel() < b * k_cache.shape[1]):
        counts = torch.zeros(b * k_cache.shape[1], dtype=torch.int32, device=q.device)
    return scratch[0], scratch[1], counts


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor,
                 sm_scale: float, cfg: DecodeConfig, k_scale: float = 1.0, v_scale: float = 1.0,
                 softcap: float | None = None, window: int | None = None,
                 scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 k_scale_cache: torch.Tensor | None = None,
                 v_scale_cache: torch.Tensor | None = None,
                 q_bias: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` (one token per request) over paged K ``[pages, Hkv, P, D]`` and V (the
    same, or ``[pages, Hkv, D, P]`` when ``cfg.v_t``) -> ``out [B, Hq, D]`` (written).

    int8 pages need ``k_scale_cache``/``v_scale_cache`` (float16 ``[pages, Hkv, P]``, one scale
    per token and head): key j's logits are multiplied by its K scale, P's column j by its V
    scale before P@V (``k_scale``/``v_scale`` are then unused). ``q_bias`` ``[B, Hq]`` float32
    (q . k_mean of a centered K cache) is added back to every logit before the soft-cap.

    ``scratch`` = (op ``[>= B*Hq*S, D]`` f32, lse ``[>= B*Hq*S]`` f32[, counters ``[>= B*Hkv]``
    int32, zero: a fused merge's, left zero]) lets CUDA-graph callers pass
    static buffers; otherwise they are allocated here when ``cfg.num_splits > 1``.
    """
    op, lse, counters = _scratch(q, k_cache, cfg, scratch)
    single = op is None
    if single:
        op = lse = out  # unused by the single-split kernel
    if cfg.gluon:
        if _gluon_decode(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, sm_scale, cfg,
                         k_scale, v_scale, softcap, window, _pair(k_scale_cache, v_scale_cache)):
            return out
        cfg = dataclasses.replace(cfg, gluon=False)  # this Triton cannot build it (logged)
    kern, grid, args, opts = _split_launch(q, k_cache, v_cache, block_table, kv_lens, out, op,
                                           lse, sm_scale, cfg, k_scale, v_scale, softcap, window,
                                           _pair(k_scale_cache, v_scale_cache), q_bias,
                                           counters)
    kern[grid](*args, **opts)
    if not single and not fuses_merge(cfg):
        v_out = 1.0 if k_cache.dtype == torch.int8 else float(v_scale)
        # decode_kernels' split kernels write nothing for an empty split: the merge counts the
        # live ones from the context (the packed and multi-head kernels write every split)
        live = ((kv_lens, _min_per(cfg), window, cfg.block_n)
                if cfg.pack == 1 and cfg.heads == 1 else None)
        decode_kernels.merge_splits(op, lse, out, v_out, cfg.num_splits,
                                    4 if q.shape[2] >= 128 else 2, live)
    return out


def _gluon_decode(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, sm_scale: float,
                  cfg: DecodeConfig, k_scale: float, v_scale: float, softcap, window,
                  scale_caches) -> bool:
    """``paged_decode`` through the Gluon kernel (and the merge): False when this Triton
    cannot compile it (nothing written)."""
    why = decode_8bit_gluon.fits(k_cache.dtype, q.dtype, q.shape[2], k_cache.shape[2], cfg.v_t,
                                 softcap, window)
    if why is not None:
        raise ValueError(f"the Gluon decode does not take {why}: use gluon=False")
    int8 = k_cache.dtype == torch.int8
    if int8:
        scale_cache_args(k_cache, scale_caches)  # checks them
        k_scale = v_scale = 1.0
    v_out = float(v_scale)
    if not decode_8bit_gluon.launch(q, k_cache, v_cache, block_table, kv_lens, out, op, lse,
                                    sm_scale * k_scale * LOG2E, v_out, cfg.num_splits,
                                    cfg.maxnreg, scale_caches):
        return False
    if cfg.num_splits > 1:  # the splits are cut as the Triton kernels' (whole tiles)
        decode_kernels.merge_splits(op, lse, out, v_out, cfg.num_splits,
                                    4 if q.shape[2] >= 128 else 2,
                                    (kv_lens, 0, None, cfg.block_n))
    return True


def _pair(k_scale_cache, v_scale_cache):
    return None if k_scale_cache is None else (k_scale_cache, v_scale_cache)


def compiled_split_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor,
                          sm_scale: float, cfg: DecodeConfig, softcap: float | None = None,
                          window: int | None = None, scale_caches=None):
    """The compiled split kernel that ``paged_decode`` launches for these arguments (Triton's
    ``CompiledKernel``: ``n_regs``, ``metadata.shared``), compiled or looked up without a launch.

    For kernel studies that read registers and shared memory per launch variant; writes nothing.
    """
    op, lse, counters = _scratch(q, k_cache, cfg, None)
    if op is None:
        op = lse = out
    kern, grid, args, opts = _split_launch(q, k_cache, v_cache, block_table, kv_lens, out, op,
                                           lse, sm_scale, cfg, 1.0, 1.0, softcap, window,
                                           scale_caches, counters=counters)
    return kern.warmup(*args, grid=grid, **opts)
