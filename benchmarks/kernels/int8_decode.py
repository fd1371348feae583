"""8-bit decode kernel time by format (fp8_e4m3, int8 with each int8->f16 conversion), timed as
CUDA-graph replays of one call per rotating cache copy (no host launch time; inputs never in L2).

TB/s counts the bytes a call must read (int8: the float16 scale of each token and head too).
Usage: python3 benchmarks/kernels/int8_decode.py [--quick]; writes $OUT/int8_decode.json and
prints one table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from kvfit.attention.triton_backend import TritonBackend
from kvfit.bench.kernels_common import (LAYOUTS, KVSet, ours_v_caches, ours_v_layout,
                                        scale_kwargs)
from kvfit.kernels.decode import choose_config, paged_decode

from graph_timing import graph_us  # benchmarks/kernels/, the script's own folder

LAYOUTS = {**LAYOUTS, "d256": (8, 4, 256)}
POINTS = [("qwen3-1.7b", 32, 16384), ("qwen3-1.7b", 128, 16384), ("qwen3-1.7b", 8, 16384),
          ("llama-3.1-8b", 32, 16384), ("smollm2", 32, 16384), ("smollm2", 128, 16384),
          ("d256", 32, 16384)]
QUICK = [("smollm2", 128, 16384), ("qwen3-1.7b", 128, 16384), ("qwen3-1.7b", 32, 16384),
         ("d256", 32, 16384)]


def variants(kvd: str, d: int, group: int):
    """(label, config changes) per format: int8 with each conversion; 64-d heads with groups of
    <= 4 also packed (4 sub-splits in the MMA rows, kernels/decode_packed.py; one KV head a
    program, which packing needs where the default launch takes several)."""
    out = [("int8-asm", {"i8_cvt": "asm"}), ("int8-bias", {"i8_cvt": "bias"}),
           ("int8-cast", {"i8_cvt": "cast"})] if kvd == "int8" else [(kvd, {})]
    if d <= 64 and group <= 4:
        name = "int8" if kvd == "int8" else kvd
        out += [(f"{name}-pk4" + (f"-{cvt}" if kvd == "int8" else ""),
                 {"pack": 4, "heads": 1, "block_n": 128, "v_t": False, "i8_cvt": cvt})
                for cvt in (("asm", "bias") if kvd == "int8" else ("asm",))]
    return out


def main():
    points = QUICK if "--quick" in sys.argv else POINTS
    res = []
    print(f"{'heads':>12} {'B x L':>11} {'page':>4} {'format':>10} {'us':>8} {'TB/s':>6} "
          f"{'vs fp8':>7}", flush=True)
    for layout, b, ctx in points:
        hq, hkv, d = LAYOUTS[layout]
        fp8_us = None
        for kvd in ("fp8_e4m3", "int8") + (("bfloat16",) if d <= 64 else ()):
            kv = KVSet(hkv, d, kvd, b, ctx, TritonBackend.default_page_size(kvd, d), "cuda")
            vt = ours_v_layout(kv) == "HDN"
            base = choose_config(b, hkv, hq // hkv, d, ctx, kv.dtype, torch.bfloat16, v_t=vt)
            vcs = ours_v_caches(kv)
            hnd = [c[1] for c in kv.caches]
            qs = [torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16) for _ in kv.caches]
            outs = [torch.empty_like(x) for x in qs]
            for label, change in variants(kvd, d, hq // hkv):
                cfg = dataclasses.replace(base, **change)
                vv = hnd if not cfg.v_t else vcs
                fns = [lambda i=i: paged_decode(qs[i], kv.caches[i][0], vv[i], kv.block_table,
                                                kv.kv_lens, outs[i], d ** -0.5, cfg,
                                                **scale_kwargs(kv, i))
                       for i in range(kv.reps)]
                us = graph_us(fns)
                fp8_us = us if label == "fp8_e4m3" else fp8_us
                rec = dict(layout=layout, batch=b, ctx=ctx, page=kv.page_size, format=label,
                           v_layout=ours_v_layout(kv), cfg=str(cfg), bytes=kv.bytes, us=us,
                           tbps=kv.bytes / us / 1e6, time_vs_fp8=us / fp8_us)
                res.append(rec)
                print(f"{layout:>12} {b:>4}x{ctx:<6} {kv.page_size:>4} {label:>10} {us:8.1f} "
                      f"{rec['tbps']:6.2f} {rec['time_vs_fp8']:7.3f}", flush=True)
            del kv, qs, outs, vcs, hnd
            torch.cuda.empty_cache()
    out = os.environ.get("OUT_DIR", os.environ.get("OUT", "/tmp"))
    with open(os.path.join(out, "int8_decode.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
