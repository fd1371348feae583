"""The cached-prefix TTFT probe of ``kvfit bench prefix`` (one request with a cached 4k prefix +
a 128-token tail, alone, against the same request uncached) with the prefill graphs captured as
chains of different link growths (``engine/graph_segments.GROWTH``; 0 = one graph per bucket),
one engine per growth in one process:

    PYTHONPATH=src python3 benchmarks/serve/probe_links.py --growths 0,2,3,1

Prints one line per growth: median TTFTs of --repeats probe pairs, the cached probe's fastest,
and the host time of the cached step's ``runner.execute`` (staging + the links' launches).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="src/kvfit/bench/configs/qwen3-1.7b.json")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--growths", default="0,2,3,1")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()

    import torch

    from kvfit.bench import prefix_workloads as wl
    from kvfit.config import make_config
    from kvfit.engine import graph_segments
    from kvfit.engine.llm_engine import LLMEngine

    kw = dict(model=args.model, kv_dtype=args.kv_dtype, max_num_seqs=64)
    if args.model.endswith(".json"):
        kw["load_format"] = "dummy"
    print("| growth | links | uncached TTFT ms | cached TTFT ms | ratio | fastest cached ms | "
          "cached step's execute host ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for growth in [int(x) for x in args.growths.split(",")]:
        graph_segments.GROWTH = growth
        t0 = time.perf_counter()
        eng = LLMEngine(make_config(**kw))
        build_s = time.perf_counter() - t0
        wl.ttft_probe(eng, 64, 8, 99)
        for i in range(2):
            wl.ttft_probe(eng, 4096, 128, 500 + i)
        execute = eng.runner.execute
        hosts = []

        def timed(*a, **k):
            t = time.perf_counter()
            out = execute(*a, **k)
            hosts.append((sum(n for _, n in a[0]), time.perf_counter() - t))
            return out

        eng.runner.execute = timed
        rs = [wl.ttft_probe(eng, 4096, 128, 1000 + i) for i in range(args.repeats)]
        eng.runner.execute = execute
        unc = statistics.median(r["uncached_ttft_ms"] for r in rs)
        cac = statistics.median(r["cached_ttft_ms"] for r in rs)
        host = statistics.median(1e3 * h for n, h in hosts if n == 128)
        links = eng.runner.prefill_graphs.links if eng.runner.prefill_graphs else 0
        print(f"| {growth} | {links} | {unc:.2f} | {cac:.2f} | {cac / unc:.3f} | "
              f"{min(r['cached_ttft_ms'] for r in rs):.2f} | {host:.3f} |  (engine built in "
              f"{build_s:.1f} s)", flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
