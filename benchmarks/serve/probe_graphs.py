"""The cached-prefix TTFT probe of ``kvfit bench prefix`` (one request with a cached 4k prefix +
a 128-token tail, alone, against the same request uncached) with the short-step machinery on and
off, on one engine:

- ``graph+split``: prefill/extend steps of up to --cuda-graph-max-prefill-tokens tokens replay a
  CUDA graph (engine/prefill_graph.py), their keys split over the SMs (kernels/prefill_split.py);
- ``eager+split``: the same steps eager (the graphs set aside), keys split;
- ``eager``: eager and unsplit (what the engine did before both).

    PYTHONPATH=src python3 benchmarks/serve/probe_graphs.py \
        --model src/kvfit/bench/configs/qwen3-1.7b.json --kv-dtype fp8_e4m3 --out x.json

Prints one table (median TTFTs of --repeats probe pairs, and the cached step's forward on the
GPU timed with CUDA events around ``runner.execute`` in a synchronous step); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="src/kvfit/bench/configs/qwen3-1.7b.json")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["graph+split", "eager+split", "eager"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from kvfit.bench import prefix_workloads as wl
    from kvfit.config import make_config
    from kvfit.engine.llm_engine import LLMEngine
    from kvfit.kernels import prefill_split

    kw = dict(model=args.model, kv_dtype=args.kv_dtype, max_num_seqs=args.max_num_seqs)
    if args.model.endswith(".json"):
        kw["load_format"] = "dummy"
    t0 = time.perf_counter()
    eng = LLMEngine(make_config(**kw))
    build_s = time.perf_counter() - t0
    runner = eng.runner
    graphs = runner.prefill_graphs
    split_max = prefill_split.SPLIT_MAX_TOKENS
    rows = []
    for mode in args.modes:
        if mode == "graph+split" and graphs is None:
            print("no prefill graphs on this engine: graph+split skipped")
            continue
        runner.prefill_graphs = graphs if mode == "graph+split" else None
        prefill_split.SPLIT_MAX_TOKENS = 0 if mode == "eager" else split_max
        wl.ttft_probe(eng, 64, 8, 99)  # warm-up: compiles of this mode's kernels
        wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 500)
        probes = [wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 1000 + i)
                  for i in range(args.repeats)]
        unc = statistics.median(r["uncached_ttft_ms"] for r in probes)
        cac = statistics.median(r["cached_ttft_ms"] for r in probes)
        gpu_ms = _cached_step_gpu_ms(eng, runner, args, torch)
        rows.append({"mode": mode, "uncached_ttft_ms": unc, "cached_ttft_ms": cac,
                     "ratio": cac / unc, "cached_step_gpu_ms": gpu_ms, "probes": probes})
    runner.prefill_graphs = graphs
    prefill_split.SPLIT_MAX_TOKENS = split_max
    print(f"engine built in {build_s:.1f} s ({args.kv_dtype}); probe: {args.prefix_len} prefix "
          f"+ {args.suffix_len} new tokens, median of {args.repeats}")
    print("| mode | uncached TTFT ms | cached TTFT ms | cached/uncached | cached step GPU ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['uncached_ttft_ms']:.2f} | {r['cached_ttft_ms']:.2f} | "
              f"{r['ratio']:.3f} | {r['cached_step_gpu_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "build_s": build_s, "rows": rows}, f, indent=1)


def _cached_step_gpu_ms(eng, runner, args, torch) -> float:
    """GPU time of the cached probe's one step (events around ``runner.execute``, the engine
    in synchronous mode for that probe), median of 3."""
    import random

    from kvfit.bench import prefix_workloads as wl

    if runner.device.type != "cuda":
        return float("nan")
    times = []
    execute = runner.execute

    def timed(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(*a, **k)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        return out

    overlap = eng.overlap
    eng.overlap = False
    try:
        for i in range(3):
            runner.execute = execute
            lo, hi = wl.token_range(eng.vocab_size)
            rng = random.Random(2000 + i)
            prefix = [rng.randint(lo, hi - 1) for _ in range(args.prefix_len)]
            wl.drive(eng, [prefix + [lo] * args.suffix_len], [1], "probe")
            runner.execute = timed
            wl.drive(eng, [prefix + [lo + 1] * args.suffix_len], [1], "probe")
    finally:
        runner.execute = execute
        eng.overlap = overlap
    return statistics.median(times[-3:]) if times else float("nan")


if __name__ == "__main__":
    main()
