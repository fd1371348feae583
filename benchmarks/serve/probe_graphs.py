"""The cached-prefix TTFT probe of ``kvfit bench prefix`` (one request with a cached 4k prefix +
a 128-token tail, alone, against the same request uncached) with the short-step machinery on and
off, on one engine:

- ``graph+split``: prefill/extend steps of up to --cuda-graph-max-prefill-tokens tokens replay a
  CUDA graph (engine/prefill_graph.py), their keys split over the SMs (kernels/prefill_split.py);
- ``eager+split``: the same steps eager (the graphs set aside), keys split
  (``prefill_split.EAGER_SPLIT``);
- ``eager``: eager and unsplit (what the engine did before both, and does with
  ``--enforce-eager``).

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
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler's top kernels of one cached probe in the first mode")
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
    rows = []
    for m, mode in enumerate(args.modes):
        if mode == "graph+split" and graphs is None:
            print("no prefill graphs on this engine: graph+split skipped")
            continue
        runner.prefill_graphs = graphs if mode == "graph+split" else None
        prefill_split.EAGER_SPLIT = mode == "eager+split"
        seed = 10000 * (m + 1)  # fresh prefixes per mode: an earlier mode's are cached
        wl.ttft_probe(eng, 64, 8, seed)  # warm-up: compiles of this mode's kernels
        wl.ttft_probe(eng, args.prefix_len, args.suffix_len, seed + 1)
        probes = [wl.ttft_probe(eng, args.prefix_len, args.suffix_len, seed + 2 + i)
                  for i in range(args.repeats)]
        unc = statistics.median(r["uncached_ttft_ms"] for r in probes)
        cac = statistics.median(r["cached_ttft_ms"] for r in probes)
        gpu_ms, host_ms = _cached_step_gpu_ms(eng, runner, args, torch, seed + 100)
        rows.append({"mode": mode, "uncached_ttft_ms": unc, "cached_ttft_ms": cac,
                     "ratio": cac / unc, "cached_step_gpu_ms": gpu_ms,
                     "cached_step_host_ms": host_ms, "probes": probes})
        if args.profile and m == 0:
            _profile(eng, args, torch, seed + 200)
    runner.prefill_graphs = graphs
    prefill_split.EAGER_SPLIT = False
    print(f"engine built in {build_s:.1f} s ({args.kv_dtype}); probe: {args.prefix_len} prefix "
          f"+ {args.suffix_len} new tokens, median of {args.repeats}")
    print("| mode | uncached TTFT ms | cached TTFT ms | cached/uncached | cached step GPU ms | "
          "its host launch ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['uncached_ttft_ms']:.2f} | {r['cached_ttft_ms']:.2f} | "
              f"{r['ratio']:.3f} | {r['cached_step_gpu_ms']:.2f} | "
              f"{r['cached_step_host_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "build_s": build_s, "rows": rows}, f, indent=1)


def _profile(eng, args, torch, seed) -> None:
    """torch.profiler over one cached probe: the top GPU kernels (count, total us)."""
    import random

    from torch.profiler import ProfilerActivity, profile

    from kvfit.bench import prefix_workloads as wl

    lo, hi = wl.token_range(eng.vocab_size)
    rng = random.Random(seed)
    prefix = [rng.randint(lo, hi - 1) for _ in range(args.prefix_len)]
    wl.drive(eng, [prefix + [lo] * args.suffix_len], [1], "probe")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wl.drive(eng, [prefix + [lo + 1] * args.suffix_len], [1], "probe")
    torch.cuda.synchronize()
    kern = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = e.name[:70]
            n, t = kern.get(k, (0, 0.0))
            kern[k] = (n + 1, t + e.device_time)
    total = sum(t for _, t in kern.values())
    print(f"profile of one cached probe (graph mode): {len(kern)} kernel names, "
          f"{sum(n for n, _ in kern.values())} launches, {total / 1e3:.2f} ms GPU")
    for k, (n, t) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {t:9.1f} us  {n:4d}x  {k}")
    print("host: top CPU ops by self time")
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    for a in ops:
        print(f"  {a.self_cpu_time_total:9.1f} us  {a.count:4d}x  {a.key[:70]}")


def _cached_step_gpu_ms(eng, runner, args, torch, seed) -> tuple[float, float]:
    """GPU time of the cached probe's one step (events around ``runner.execute``, the engine
    in synchronous mode for that probe) and the host time of the ``execute`` call itself (its
    launches), medians of 3."""
    import random

    from kvfit.bench import prefix_workloads as wl

    if runner.device.type != "cuda":
        return float("nan"), float("nan")
    times, host = [], []
    execute = runner.execute

    def timed(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        out = execute(*a, **k)
        host.append((time.perf_counter() - t) * 1e3)
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
            rng = random.Random(seed + i)
            prefix = [rng.randint(lo, hi - 1) for _ in range(args.prefix_len)]
            wl.drive(eng, [prefix + [lo] * args.suffix_len], [1], "probe")
            runner.execute = timed
            wl.drive(eng, [prefix + [lo + 1] * args.suffix_len], [1], "probe")
    finally:
        runner.execute = execute
        eng.overlap = overlap
    if not times:
        return float("nan"), float("nan")
    return statistics.median(times[-3:]), statistics.median(host[-3:])


if __name__ == "__main__":
    main()
