"""Host side of the Gluon MLA decode kernels (Hopper): where they run (``gluon_available``),
which shapes they take (``gluon_fits``), their launch (``launch``: ``mla_decode_gluon``; for
``MLAConfig.pipe`` ``mla_decode_fp8_pipe``, for ``MLAConfig.regs`` ``mla_decode_fp8_regs``),
and what happens when the installed Triton cannot compile them: Gluon is Triton's experimental
layer and its names move between releases (``async_copy_global_to_shared`` became
``async_load`` in 3.7), so a compile failure is logged once, ``usable`` turns false
(``kernels.mla.decode_config`` then picks the Triton kernels) and ``launch`` returns False for
its caller to run them instead. Owns the failure record; launches write ``out`` or the split
scratch.
"""

from __future__ import annotations

import math

import torch

from kvfit.kernels import mla_decode_fp8_pipe, mla_decode_fp8_regs, mla_decode_gluon
from kvfit.kernels.gluon_hopper import gluon_available, launch_or_record

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_failures: list[str] = []  # the first compile failure (at most one entry)


def gluon_fits(rank: int, rope: int, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """The shapes and types the Gluon decode kernels take: DeepSeek's 512 + 64 slab, 16-bit
    queries, 16- or 8-bit latents."""
    return (rank == 512 and rope == 64 and q_dtype in (torch.bfloat16, torch.float16)
            and cache_dtype in (torch.bfloat16, torch.float16) + FP8)


def usable(device_index: int = 0) -> bool:
    """``gluon_available`` and no compile failure in this process."""
    return not _failures and gluon_available(device_index)


def launch(q, cache, block_table, kv_lens, out, op, lse, rank: int, qk_scale: float,
           out_scale: float, cfg) -> bool:
    """One Gluon decode launch (one query per request; ``qk_scale`` = softmax scale x latent
    scale x log2(e)): True when it ran, False when this Triton cannot compile the kernel (then
    nothing was written). Shapes outside ``gluon_fits`` raise ValueError."""
    b, h, slab = q.shape
    if not gluon_fits(rank, slab - rank, cache.dtype, q.dtype):
        raise ValueError(f"the Gluon MLA decode takes 512 + 64 slabs of 16- or 8-bit latents and "
                         f"16-bit queries, got {rank} + {slab - rank}, {cache.dtype}, {q.dtype}: "
                         f"use decode_config(gluon=False)")
    if cfg.regs and cache.dtype not in FP8:
        raise ValueError(f"the register-operand Gluon MLA decode reads 8-bit latents, got "
                         f"{cache.dtype}: use regs=False")
    if cfg.pipe and cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the pipelined Gluon MLA decode reads e4m3 latents, got {cache.dtype}: "
                         f"use pipe=False")
    if _failures:
        return False
    single = cfg.num_splits == 1
    hblk = math.ceil(h / cfg.block_m)
    args = (q, cache, block_table, kv_lens, out, out if single else op, out if single else lse,
            float(qk_scale), float(out_scale), q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), cache.stride(0), block_table.stride(0), cfg.num_splits)
    shape = dict(H=h, RANK=rank, ROPE=slab - rank, SLAB=slab, PAGE=cache.shape[1],
                 BLOCK_H=cfg.block_m, BLOCK_N=cfg.block_n, HBLK=hblk, SINGLE=single,
                 num_warps=cfg.num_warps)
    if not cfg.regs:
        shape.update(CHUNK=16, XV=cfg.conv_vec)

    def run():
        if cfg.regs:
            mma, lw, la = mla_decode_fp8_regs.layouts(cfg.block_m)
            fmt = "e4m3" if cache.dtype == torch.float8_e4m3fn else "e5m2"
            mla_decode_fp8_regs.build()[(b * hblk, cfg.num_splits)](
                *args, **shape, MMA=mma, LW=lw, LA=la, ASM=mla_decode_fp8_regs.WORD_ASM[fmt],
                L2_AHEAD=cfg.l2_ahead)
        elif cfg.pipe:
            mla_decode_fp8_pipe.build()[(b * hblk, cfg.num_splits)](*args, **shape)
        else:
            mla_decode_gluon.build()[(b * hblk, cfg.num_splits)](
                *args, STAGES=cfg.num_stages, CONVERT=cache.dtype in FP8,
                QFP8=cfg.qfp8 and cache.dtype == torch.float8_e4m3fn, **shape)

    return launch_or_record(run, _failures, "Gluon MLA decode kernel",
                            "MLA decode runs the Triton kernels (slower on Hopper: "
                            "docs/benchmarks.md, 'MLA decode in Gluon')", known="3.6-3.9")
