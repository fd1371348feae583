"""Where the time of ``kvfit bench prefix``'s TTFT probe goes (one request with a cached 4k
prefix + a 128-token tail, alone, against the same request uncached).

    PYTHONPATH=src python3 benchmarks/serve/profile_probe.py --out-dir /tmp/probe \
        --model src/kvfit/bench/configs/qwen3-1.7b.json --kv-dtype fp8_e4m3

Prints the probe's TTFTs (median of --repeats pairs), a host-side split of one cached probe
(admission/scheduling, the step's launch, sampling launch, waiting for the ids, processing),
the GPU time of the cached step's forward alone (events around ``runner.execute``), and the
top kernels of a torch.profiler trace of one cached probe (the trace goes to --out-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict


def build(args):
    from kvfit.config import make_config
    from kvfit.engine.llm_engine import LLMEngine

    kw = dict(model=args.model, kv_dtype=args.kv_dtype, max_num_seqs=args.max_num_seqs)
    if args.model.endswith(".json"):
        kw["load_format"] = "dummy"
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return LLMEngine(make_config(**kw))


class Split:
    """Host seconds spent inside wrapped callables (by name) while ``on``."""

    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self.on = False

    def wrap(self, obj, name, label):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[label] += time.perf_counter() - t0
                self.n[label] += 1

        setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="src/kvfit/bench/configs/qwen3-1.7b.json")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--random-reps", type=int, default=2,
                   help="random batches (128 prompts of 100-1024 tokens, 16 out) run at the end")
    p.add_argument("--offline-serve-log", default=None,
                   help="first run bench serve's offline workload with a step log written here")
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    import torch

    from kvfit.bench import prefix_workloads as wl
    from kvfit.engine import inflight, llm_engine

    t0 = time.perf_counter()
    eng = build(args)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    wl.ttft_probe(eng, 64, 8, 99)
    if args.offline_serve_log:
        # ``kvfit bench serve --offline``'s run on this engine (max_num_seqs 64): 256 x 1,024
        # random ids in / 256 out, every step timed (compare with the server's step log)
        from kvfit.bench.serve import make_prompts
        from kvfit.bench.step_timer import StepTimer, summarize
        from kvfit.sampling_params import SamplingParams

        prompts = make_prompts(256, 1024)
        wl.drive(eng, prompts[:1], [4], "warm")
        timer = StepTimer().attach(eng)
        t = time.perf_counter()
        rids = []
        for i, pr in enumerate(prompts):
            rids.append(f"off-{i}")
            eng.add_request(rids[-1], pr, SamplingParams(temperature=0.0, max_tokens=256,
                                                         ignore_eos=True))
        n_out = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    n_out += len(o.outputs[0].token_ids)
        dt = time.perf_counter() - t
        timer.dump(args.offline_serve_log)
        timer.detach()
        summ = summarize(timer.rows)
        off_result = {"output_tokens": n_out, "seconds": dt, "output_tok_s": n_out / dt,
                      "steps": summ}
        print(f"offline serve workload: {n_out} tokens in {dt:.3f} s = {n_out / dt:.1f} output "
              f"tok/s; steps: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                            f"{k}={v}" for k, v in summ.items()), flush=True)
    for i in range(2):
        wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 500 + i)
    res = {"probes": [wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 1000 + i)
                      for i in range(args.repeats)]}
    if args.offline_serve_log:
        res["offline_serve"] = off_result
    unc = statistics.median(r["uncached_ttft_ms"] for r in res["probes"])
    cac = statistics.median(r["cached_ttft_ms"] for r in res["probes"])
    res["probe_median"] = {"uncached_ttft_ms": unc, "cached_ttft_ms": cac, "ratio": cac / unc}
    if eng.overlap:  # the same probes with the synchronous step (no overlap) on this engine
        eng.overlap = False
        sync = [wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 1500 + i)
                for i in range(args.repeats)]
        eng.overlap = True
        res["probe_sync"] = {k: statistics.median(r[k] for r in sync)
                             for k in ("uncached_ttft_ms", "cached_ttft_ms")}
        print(f"probe without overlap: uncached {res['probe_sync']['uncached_ttft_ms']:.2f} ms, "
              f"cached {res['probe_sync']['cached_ttft_ms']:.2f} ms", flush=True)
    with open(os.path.join(args.out_dir, "probe_profile.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)  # rewritten at the end with the rest
    print(f"probe: uncached {unc:.2f} ms, cached {cac:.2f} ms, ratio {cac / unc:.3f}", flush=True)

    # host split of cached probes
    sp = Split()
    sp.wrap(eng.scheduler, "schedule", "schedule")
    sp.wrap(eng.scheduler, "cache_full_pages", "cache_full_pages")
    sp.wrap(eng.runner, "execute", "runner.execute")
    sp.wrap(eng.runner.backend, "prepare", "backend.prepare")
    sp.wrap(eng, "_process", "_process")
    sp.wrap(eng, "add_request", "add_request")
    sp.wrap(inflight.InFlightStep, "wait_ids", "wait_ids")
    orig_ls = llm_engine.launch_sampling

    def ls(*a, **k):
        t = time.perf_counter()
        try:
            return orig_ls(*a, **k)
        finally:
            sp.t["launch_sampling"] += time.perf_counter() - t
            sp.n["launch_sampling"] += 1

    llm_engine.launch_sampling = ls
    sp.wrap(eng, "step", "step")
    walls = []
    for i in range(args.repeats):
        import random

        rng = random.Random(2000 + i)
        lo, hi = wl.token_range(eng.vocab_size)
        prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
        wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]], [1],
                 "p")
        sp.on = True
        t = time.perf_counter()
        r, _ = wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]],
                        [1], "p")
        walls.append(time.perf_counter() - t)
        sp.on = False
    n = args.repeats
    split = {k: 1e3 * v / n for k, v in sp.t.items()}
    split["drive_wall"] = 1e3 * sum(walls) / n
    split["calls_per_probe"] = {k: v / n for k, v in sp.n.items()}
    res["host_split_ms"] = split
    print("cached probe, host ms per probe: " + ", ".join(
        f"{k}={v:.2f}" for k, v in split.items() if isinstance(v, float)), flush=True)
    print("calls per probe:", split["calls_per_probe"], flush=True)

    # GPU time of the cached step's forward alone: CUDA events around runner.execute
    if torch.cuda.is_available():
        ev = []
        orig_exec = eng.runner.execute.__wrapped__ if hasattr(eng.runner.execute, "__wrapped__") \
            else None
        exec_fn = eng.runner.execute

        def exec_timed(*a, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            s.record()
            out = exec_fn(*a, **k)
            e.record()
            h1 = time.perf_counter()
            ev.append((s, e, h1 - h0, len(a[0]), sum(n for _, n in a[0])))
            return out

        eng.runner.execute = exec_timed
        for i in range(3):
            wl.ttft_probe(eng, args.prefix_len, args.suffix_len, 3000 + i)
        torch.cuda.synchronize()
        rows = [(s.elapsed_time(e), 1e3 * h, b, t) for s, e, h, b, t in ev]
        res["execute"] = rows
        for g, h, b, t in rows:
            print(f"execute: {t} tokens in {b} reqs: GPU {g:.2f} ms (events), host launch "
                  f"{h:.2f} ms", flush=True)
        eng.runner.execute = exec_fn
        del orig_exec

        # host<->device syncs inside one cached probe (the last, the ids' wait, is expected)
        import traceback
        import warnings

        rng = __import__("random").Random(3500)
        lo, hi = wl.token_range(eng.vocab_size)
        prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
        wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]], [1],
                 "p")
        torch.cuda.synchronize()
        seen = []
        old_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            seen.append(f"{category.__name__}: {str(message)[:160]}\n"
                        + "".join(traceback.format_stack(limit=9)[:-2]))

        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in
                                         range(args.suffix_len)]], [1], "p")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old_show
        print(f"syncs in one cached probe: {len(seen)}", flush=True)
        for s in seen[:12]:
            print("----\n" + s, flush=True)
        res["syncs"] = seen

        from torch.profiler import ProfilerActivity, profile

        rng_seed = 4000
        import random

        rng = random.Random(rng_seed)
        lo, hi = wl.token_range(eng.vocab_size)
        prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
        wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]], [1],
                 "p")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]],
                     [1], "p")
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(args.out_dir, "probe_cached_trace.json"))
        ka = prof.key_averages()
        table = ka.table(sort_by="cuda_time_total", row_limit=25)
        print(table, flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        res["profile_kernels"] = len(kernels)
        res["profile_kernel_ms"] = sum(e.device_time for e in kernels) / 1e3
        print(f"profiled cached probe: {len(kernels)} kernels, {res['profile_kernel_ms']:.2f} ms "
              f"of kernel time", flush=True)

        # the host's Python functions in one cached probe (cProfile: the per-function split of
        # the host milliseconds above; cProfile's own overhead inflates them evenly)
        import cProfile
        import io
        import pstats

        prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
        wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]], [1],
                 "p")
        torch.cuda.synchronize()
        prof_py = cProfile.Profile()
        prof_py.enable()
        wl.drive(eng, [prefix + [rng.randrange(lo, hi) for _ in range(args.suffix_len)]], [1],
                 "p")
        prof_py.disable()
        stats = pstats.Stats(prof_py, stream=io.StringIO()).stats
        # pstats rows: (primitive calls, calls, tottime, cumtime, callers)
        for col, key in ((2, "self"), (3, "cumulative")):
            top = sorted(stats.items(), key=lambda kv: -kv[1][col])[:30]
            print(f"cProfile of one cached probe, top by {key} us:", flush=True)
            for (path, line, fn), st in top:
                print(f"  {1e6 * st[2]:8.1f} self {1e6 * st[3]:8.1f} cum {st[1]:5d} calls  "
                      f"{os.path.basename(path)}:{line}({fn})", flush=True)
    # the random-workload TTFT with caching on: the same kind of batch twice on this engine (a
    # first run that pays one-off costs, e.g. kernel compiles for new shapes, shows here)
    import random

    for rep in range(args.random_reps):
        rng = random.Random(7 + rep)
        lo, hi = wl.token_range(eng.vocab_size)
        prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(100, 1024))]
                   for _ in range(128)]
        r, _ = wl.drive(eng, prompts, [16] * len(prompts), "random")
        s = r.summary()
        res[f"random_{rep}"] = s
        print(f"random batch {rep}: TTFT median {s['ttft_median_ms']:.1f} ms, p99 "
              f"{s['ttft_p99_ms']:.1f}, {s['seconds']:.2f} s", flush=True)
    with open(os.path.join(args.out_dir, "probe_profile.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
