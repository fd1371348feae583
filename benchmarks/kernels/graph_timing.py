"""Decode kernel time with and without host launch overhead, at the small points.

`triton.testing.do_bench` (what `kvfit bench kernels` uses) records an event, calls the Python
launcher and records another: when one call's launch work on the host (two Triton launches and
two allocations) takes longer than the GPU's work, the gap is timed too. Here each point is timed
both ways: do_bench, and CUDA-graph replays of one call per rotating cache copy (the way the
engine runs decode), medians of 5. Usage: python3 graph_timing.py; writes $OUT/graph_timing.json.
"""

import json
import os

import torch
import triton

from kvfit.attention.triton_backend import TritonBackend
from kvfit.bench.kernels_common import (LAYOUTS, KVSet, graph_us, ours_v_caches,
                                        ours_v_layout, rotating)
from kvfit.kernels.decode import choose_config, paged_decode

POINTS = [("smollm2", 8, 16384), ("smollm2", 32, 16384), ("smollm2", 128, 4096),
          ("smollm2", 128, 16384), ("llama-3.1-8b", 8, 16384), ("qwen3-1.7b", 8, 16384),
          ("qwen3-1.7b", 32, 16384)]


def main():
    res = []
    for kvd in ("fp8_e4m3", "bfloat16"):
        for layout, b, ctx in POINTS:
            hq, hkv, d = LAYOUTS[layout]
            kv = KVSet(hkv, d, kvd, b, ctx, TritonBackend.default_page_size(kvd, d), "cuda")
            vt = ours_v_layout(kv) == "HDN"
            cfg = choose_config(b, hkv, hq // hkv, d, ctx, kv.dtype, torch.bfloat16, v_t=vt)
            vcs = ours_v_caches(kv)
            qs = [torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16) for _ in kv.caches]
            outs = [torch.empty_like(x) for x in qs]
            fns = [lambda i=i: paged_decode(qs[i], kv.caches[i][0], vcs[i], kv.block_table,
                                            kv.kv_lens, outs[i], d ** -0.5, cfg)
                   for i in range(kv.reps)]
            eager = triton.testing.do_bench(rotating(fns), warmup=25, rep=150,
                                            return_mode="median") * 1e3
            graph = graph_us(fns)
            rec = dict(layout=layout, kv=kvd, batch=b, ctx=ctx, page=kv.page_size,
                       splits=cfg.num_splits, mb=kv.bytes / 1e6, do_bench_us=eager,
                       graph_us=graph, do_bench_tbps=kv.bytes / eager / 1e6,
                       graph_tbps=kv.bytes / graph / 1e6)
            res.append(rec)
            print(f"{layout:>12} {kvd:>8} {b:>3} x {ctx:<5} p{kv.page_size:<2} "
                  f"{rec['mb']:6.0f} MB  do_bench {eager:7.1f} us {rec['do_bench_tbps']:.2f} TB/s"
                  f" | graph {graph:7.1f} us {rec['graph_tbps']:.2f} TB/s", flush=True)
            del kv
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "graph_timing.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
