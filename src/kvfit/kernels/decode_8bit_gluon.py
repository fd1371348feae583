"""The Gluon 8-bit decode's host side: where it runs (``fits``, ``available``, the per-GPU
``DEFAULT_ON``), its launch shape per head size (``GLUON_TILES``) and its launch, with the
fallback when the installed Triton cannot compile it. The kernel and its design are in
``decode_8bit_gluon_kernel``, its register layouts in ``decode_8bit_gluon_layouts``;
``kernels/decode.py`` launches it for a ``DecodeConfig`` whose ``gluon`` is set. Owns the
process's record of a compile failure (``_failures``).
"""
from __future__ import annotations

import torch

from kvfit.kernels.decode_8bit_gluon_kernel import build
from kvfit.kernels.decode_8bit_gluon_layouts import int8_key_layouts, operand_layouts
from kvfit.kernels.gluon_hopper import gluon_available, launch_or_record

__all__ = ["build", "operand_layouts", "int8_key_layouts", "DEFAULT_ON", "EXCHANGE_MAX",
           "L2_AHEAD", "GLUON_TILES", "PAGE_CODES", "kind", "default_on", "engine_default", "fits",
           "available", "launch_args", "launch"]

# the tile's maximum exchanged through shared memory with one barrier (gluon_hopper._tile_max,
# which also stands for the barrier before P's store) instead of Gluon's reduction across the
# warps: two barriers fewer a tile (sm_90 compile). Its output equals the reduction's bit for bit
# (tests/gpu/test_decode_8bit_gluon.py, passed on an H100); timed with it off and on in one call
# (reproduce.sh exchange, H100, 2026-12-06): 64-d 0.6-1.4% faster, 128-d within +-0.5% (noise),
# batch 1 equal (docs/benchmarks.md, twenty-fourth session). On: the same answer, one code path
# with the int4 and MLA register kernels
EXCHANGE_MAX = True

# the launch per head size: (programs per SM in the split rule, register cap); sm_90 compile
# (Triton 3.6): 64-d 76 (fp8) / 80 at the cap (int8; 85 uncapped, 5 an SM: 1.33x the time on
# an H100) registers, 6 an SM; 128-d 119 (fp8) / 127 at the cap (int8), 4 an SM; 256-d 202-233,
# 2 an SM; a few KB of shared memory (the query and P)
GLUON_TILES = {64: (6, 80), 128: (4, 128), 256: (2, None)}
# per head size: how many tiles ahead each tile's lines are asked of L2 (prefetch.global.L2, no
# registers held; 0: none), for the H200, whose 64-d decode reads 3.3-4.0 TB/s of its 4.25 where
# the H100's reads 99% of its copy: more bytes must be in flight there. Off until timed
# (reproduce.sh g8-l2); sm_90 compile in docs/benchmarks.md (twenty-fifth session)
L2_AHEAD = {64: 0, 128: 0, 256: 0}
# per GPU (a substring of its CUDA device name): the (page kind, head size) pairs whose decode
# runs this kernel by default (the triton backend's choice), where it measured faster than the
# Triton kernel (docs/benchmarks.md): H100 80GB HBM3, 2026-12-06: fp8 0.87-0.99x the Triton fp8
# kernel's time at 64/128/256-d and batch 1-128; int8 0.98-1.02x the Triton fp8 time at
# 128/256-d and 0.86-0.95x the Triton int8 time at 64-d, its keys on s8 MMAs. H200, 2026-12-06:
# fp8 0.80-0.98x the Triton fp8 kernel's time, int8 0.80-0.89x the Triton int8 kernel's, at
# every head size and batch 1-128 (end to end, 64 x 16k: +10.7% fp8, +11.7% int8 decode tok/s).
# A GPU not listed keeps the Triton kernel.
_ALL = frozenset({("fp8", 64), ("fp8", 128), ("fp8", 256), ("int8", 64), ("int8", 128),
                  ("int8", 256)})
DEFAULT_ON: dict = {"H100": _ALL, "H200": _ALL}
_failures: list[str] = []  # the first compile failure of the kernel in this process, if any


# the page dtypes it reads: (their kind in DEFAULT_ON, the kernel's CODE)
PAGE_CODES = {torch.float8_e4m3fn: ("fp8", 0), torch.float8_e5m2: ("fp8", 1),
              torch.int8: ("int8", 2)}


def kind(cache_dtype: torch.dtype) -> str | None:
    """"fp8", "int8" or None (a page dtype this kernel does not read)."""
    return PAGE_CODES.get(cache_dtype, (None, None))[0]


def default_on(page_kind: str | None, head_dim: int, device_name: str) -> bool:
    """Whether ``DEFAULT_ON`` lists (page kind, head size) for the GPU named ``device_name``."""
    return any(gpu in device_name and (page_kind, head_dim) in pairs
               for gpu, pairs in DEFAULT_ON.items())


def fits(cache_dtype: torch.dtype, q_dtype: torch.dtype, head_dim: int, page_size: int,
         v_t: bool, softcap=None, window=None) -> str | None:
    """None when a decode of these pages can run this kernel, else the reason it cannot."""
    if kind(cache_dtype) is None:
        return f"{cache_dtype} pages (it reads fp8_e4m3, fp8_e5m2 and int8)"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"{q_dtype} queries (it takes 16-bit ones)"
    if head_dim not in GLUON_TILES:
        return f"head_dim {head_dim} (it takes {sorted(GLUON_TILES)})"
    if page_size not in (16, 32, 64):
        return f"pages of {page_size} tokens (it takes 16, 32 or 64)"
    if not v_t:
        return "HND V pages (it reads token-minor V, the pool's v_layout 'HDN')"
    if softcap is not None or window is not None:
        return "a soft-cap or a sliding window"
    return None


def engine_default(cache_dtype: torch.dtype, q_dtype: torch.dtype, head_dim: int,
                   page_size: int, v_t: bool, device, softcap=None) -> bool:
    """Whether the triton backend decodes these pages with this kernel: a Hopper GPU whose
    ``DEFAULT_ON`` entry lists (page kind, head size), and the kernel fits."""
    dev = torch.device(device)  # (a pool may name its device by a string)
    return bool(dev.type == "cuda" and available(dev)
                and default_on(kind(cache_dtype), head_dim, torch.cuda.get_device_name(dev))
                and fits(cache_dtype, q_dtype, head_dim, page_size, v_t, softcap) is None)


def available(device=None) -> bool:
    """A Hopper GPU with Gluon's Hopper module, and no compile failure in this process."""
    if _failures or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    return gluon_available(index)


def launch_args(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, qk_scale: float,
                v_out: float, num_splits: int, scale_caches=None):
    """(grid, positional args, constexprs) of one launch; ``scale_caches`` (K's, V's float16
    ``[pages, Hkv, P]``) for int8 pages, ``qk_scale`` the base-2 softmax scale (times fp8's
    per-tensor K scale), ``v_out`` fp8's V scale for a single split's output (1 otherwise)."""
    import triton

    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    ks, vs = scale_caches if int8 else (k_cache, k_cache)
    if int8 and max(ks.numel(), vs.numel()) >= 2 ** 31:  # the kernel's 32-bit scale offsets
        raise ValueError(f"int8 scale caches of {ks.numel():,} elements: the Gluon decode "
                         f"indexes them with 32-bit offsets (< 2^31); use gluon=False")
    args = (q, out, op, lse, k_cache, v_cache, ks, vs, block_table, kv_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
            k_cache.stride(1), ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
            block_table.stride(0), float(qk_scale), float(v_out), num_splits)
    block_h = max(8, triton.next_power_of_2(hq // hkv))
    mma, lk, lv, lak, lav = operand_layouts(d, k_cache.shape[2], block_h)
    mma_i = mma
    if int8:  # keys through s8 MMAs
        mma_i, lk, lak = int8_key_layouts(d, block_h)
    code = PAGE_CODES[k_cache.dtype][1]
    consts = dict(G=hq // hkv, BLOCK_H=block_h, D=d, PAGE=k_cache.shape[2], CODE=code,
                  SINGLE=num_splits == 1, MMA=mma, MMA_I=mma_i, LK=lk, LV=lv, LAK=lak,
                  LAV=lav, XMAX=EXCHANGE_MAX, L2_AHEAD=L2_AHEAD.get(d, 0), num_warps=4)
    return (b, hkv, num_splits), args, consts


def launch(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, qk_scale: float,
           v_out: float, num_splits: int, maxnreg: int | None = None,
           scale_caches=None) -> bool:
    """One launch: True when it ran, False when this Triton cannot compile the kernel (logged
    once, nothing written: the caller runs the Triton kernel)."""
    grid, args, consts = launch_args(q, k_cache, v_cache, block_table, kv_lens, out, op, lse,
                                     qk_scale, v_out, num_splits, scale_caches)
    if maxnreg:
        consts["maxnreg"] = maxnreg
    return launch_or_record(lambda: build()[grid](*args, **consts), _failures,
                            "Gluon 8-bit decode kernel", "8-bit decode runs the Triton kernel")
