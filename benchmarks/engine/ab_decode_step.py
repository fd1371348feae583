"""Same-call A/B of the decode step of whichever kvfit tree is on PYTHONPATH (issue 13, batch 1).

Run once per tree (PYTHONPATH=<tree>/src) in one GPU job; every tree gets the same points, the
same timing code (``kvfit.bench.seed_points.decode_point``, what ``kvfit bench seed`` times) and the same
pool. Per KV dtype it builds one ModelRunner (Qwen3-1.7B shape, random weights, graphs to 64,
default backend and page size) and reports:
- seed decode tok/s at (batch, context) points, median of ``--repeats`` runs of ``--steps`` steps
  (and with ``--overlapped`` the same steps with no host sync between them);
- the host time of one ``graphs.run`` call (staging + prepare + replay launch) and of the LM head
  + argmax launch, measured from an idle GPU (so nothing waits on the device), median of 50;
- the GPU time of one graph replay alone (CUDA events, replays back to back: no host in between);
- kernels per step (torch.profiler, graph replay + LM head + argmax), the top kernels by time,
  and a chrome trace of one step with the host calls around it (``--trace-dir``).
Prints one line per figure and a JSON line prefixed ``RESULT`` (collected by the job script).

Usage: python3 ab_decode_step.py --label main --kv-dtypes bfloat16,fp8_e4m3
       [--points 1x1024,64x1024,1x16384] [--steps 32] [--repeats 3] [--trace-dir DIR]
       [--one-token on|off] [--lm-head-gemv on|off] [--pdl on|off]
       [--min-split-tokens N] [--overlapped]
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import statistics
import time
import types

import torch

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "kvfit", "bench",
                     "configs", "qwen3-1.7b.json")


EXTRA_CONFIG: dict = {}  # EngineConfig fields of the run (--small-path)


def _sync():
    torch.cuda.synchronize()


def build_runner(kvd: str, tokens: int, max_len: int, max_bs: int, model: str,
                 backend: str | None = None):
    from kvfit.config import make_config
    from kvfit.engine.runner import ModelRunner

    extra = {} if backend is None else {"attention_backend": backend}
    extra.update(EXTRA_CONFIG)
    cfg = make_config(model=model, load_format="dummy", kv_dtype=kvd, device="cuda",
                      num_tokens=tokens, max_model_len=max_len, max_num_seqs=max_bs,
                      cuda_graph_max_bs=max_bs, max_num_batched_tokens=1024, **extra)
    return ModelRunner(cfg)


def decode_overlapped(runner, batch: int, ctx: int, steps: int) -> float:
    """tok/s of ``steps`` graph decode steps with no host sync between them: positions advance on
    the device (``kvfit bench seed``'s ``decode_point`` makes them with a pageable copy, which
    waits for the GPU every step), so the host stages step N+1 while the GPU runs step N, as the
    engine's overlap scheduling does. Same pages, tables and graphs as ``decode_point``."""
    ps = runner.pool.page_size
    per = -(-(ctx + steps + 4) // ps)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    toks = torch.randint(0, runner.hf_config.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx - 1, device="cuda")
    lens = [ctx] * batch

    def step():
        nonlocal toks, pos
        for i in range(batch):
            lens[i] += 1
        pos = pos + 1
        hidden = runner.graphs.run(toks, pos, lens, tables)
        toks = runner.model.compute_logits(hidden).argmax(-1)

    with torch.inference_mode():
        for _ in range(3):
            step()
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
    return batch * steps / (time.perf_counter() - t0)


def host_and_gpu_times(runner, ctx: int, reps: int = 50) -> dict:
    """Host time of graphs.run and of the LM head + argmax (GPU idle before each), GPU time of
    a replay alone (events over back-to-back replays)."""
    ps = runner.pool.page_size
    table = [list(range(-(-(ctx + reps + 8) // ps)))]
    toks = torch.randint(0, 1000, (1,), device="cuda")
    run_t, head_t = [], []
    with torch.inference_mode():
        for i in range(reps + 3):
            lens = [ctx + i]
            pos = torch.tensor([ctx + i - 1], device="cuda")
            _sync()
            t0 = time.perf_counter()
            h = runner.graphs.run(toks, pos, lens, table)
            t1 = time.perf_counter()
            toks = runner.model.compute_logits(h).argmax(-1)
            t2 = time.perf_counter()
            _sync()
            if i >= 3:
                run_t.append(t1 - t0)
                head_t.append(t2 - t1)
        g = runner.graphs.graphs[1]
        for _ in range(3):
            g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync()
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        _sync()
    return {"host_graphs_run_us": 1e6 * statistics.median(run_t),
            "host_head_argmax_us": 1e6 * statistics.median(head_t),
            "gpu_replay_us": 1e3 * e0.elapsed_time(e1) / reps}


def profile_step(runner, ctx: int, trace_path: str | None, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ps = runner.pool.page_size
    table = [list(range(-(-(ctx + 16) // ps)))]
    toks = torch.randint(0, 1000, (1,), device="cuda")
    pos = torch.tensor([ctx - 1], device="cuda")

    def step():
        h = runner.graphs.run(toks, pos, [ctx], table)
        runner.model.compute_logits(h).argmax(-1)

    with torch.inference_mode():
        for _ in range(3):
            step()
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            _sync()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by, tm = collections.Counter(), collections.Counter()
    for e in kern:
        by[e.name[:80]] += 1
        tm[e.name[:80]] += e.device_time
    top = [{"name": n, "per_step": by[n] / steps, "us_each": tm[n] / by[n]}
           for n, _ in sorted(tm.items(), key=lambda kv: -kv[1])[:14]]
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return {"kernels_per_step": len(kern) / steps,
            "gpu_kernel_us_per_step": sum(e.device_time for e in kern) / steps, "top": top}


def wait_barrier(spec: str, name: str, limit_s: float = 20.0) -> None:
    """Marks ``name`` ready in the barrier folder, then waits until N names are (``DIR:N``)."""
    folder, n = spec.rsplit(":", 1)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, name), "w").close()
    t0 = time.time()
    while len(os.listdir(folder)) < int(n) and time.time() - t0 < limit_s:
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3")
    p.add_argument("--points", default="1x1024,64x1024,1x16384")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--one-token", choices=["on", "off"], default="on",
                   help="trees with kvfit.models.decode_rows (or one_token): that path on or off")
    p.add_argument("--small-path", choices=["gemv", "rows_gemm", "off", "default"],
                   default="default",
                   help="trees with EngineConfig.decode_gemv: the small-step path (gemv: "
                        "decode_gemv on; rows_gemm: decode_rows.ROWS_GEMM; off: neither; "
                        "--one-token is ignored there)")
    p.add_argument("--lm-head-gemv", choices=["on", "off", "default"], default="default",
                   help="trees with decode_rows/one_token: the LM head through that GEMM")
    p.add_argument("--overlapped", action="store_true",
                   help="also time each point with no host sync between steps")
    p.add_argument("--pdl", choices=["on", "off", "default"], default="default",
                   help="trees with kvfit.kernels.pdl: programmatic dependent launch")
    p.add_argument("--min-split-tokens", type=int, default=None,
                   help="kernels/decode.py MIN_SPLIT_TOKENS: the fewest tokens per decode split")
    p.add_argument("--attention-backend", default=None, help="default: the engine's auto")
    p.add_argument("--barrier", default=None,
                   help="DIR:N: before measuring, wait (at most 20 s) until N processes have "
                        "built their runners (a file each in DIR)")
    p.add_argument("--lock", default=None,
                   help="a file held (flock) around each KV dtype's measurements: processes "
                        "started together build their runners in parallel and measure one at "
                        "a time")
    args = p.parse_args()
    if args.pdl != "default":
        from kvfit.kernels import pdl

        pdl.ENABLED = args.pdl == "on"
    if args.min_split_tokens is not None:
        from kvfit.kernels import decode

        decode.MIN_SPLIT_TOKENS = args.min_split_tokens
    try:
        try:
            from kvfit.models import decode_rows as one_token  # the batch-invariant rows path
        except ImportError:
            from kvfit.models import one_token  # trees with the batch-1 GEMV path

        if hasattr(one_token, "GEMV_MAX_ROWS"):  # trees with EngineConfig.decode_gemv
            if args.small_path != "default":
                EXTRA_CONFIG["decode_gemv"] = "on" if args.small_path == "gemv" else "off"
                one_token.ROWS_GEMM = args.small_path == "rows_gemm"
        else:
            one_token.ENABLED = args.one_token == "on"
        if args.lm_head_gemv != "default":
            one_token.LM_HEAD = args.lm_head_gemv == "on"
    except ImportError:  # trees before the one-token path
        pass
    import kvfit
    try:  # trees after tp2: the points live in bench/seed_points.py
        from kvfit.bench import seed_points as seed

        def fill(pool):
            seed.fill_pool_of(types.SimpleNamespace(pool=pool))
    except ImportError:
        from kvfit.bench import seed

        fill = getattr(seed, "fill_pool", None) or getattr(seed, "_fill_pool")
    from kvfit.bench.kernels_common import copy_bandwidth

    points = [tuple(int(v) for v in s.split("x")) for s in args.points.split(",")]
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"[{args.label}] kvfit from {kvfit.__file__}; copy bandwidth {bw / 1e12:.2f} TB/s",
          flush=True)
    for kvd in args.kv_dtypes.split(","):
        t0 = time.time()
        need = sum(b * (ctx + args.steps * args.repeats + 64) for b, ctx in points) + 4096
        max_ctx = max(c for _, c in points)
        runner = build_runner(kvd, need, max_ctx + args.steps * args.repeats + 64,
                              max(b for b, _ in points), args.model, args.attention_backend)
        fill(runner.pool)
        torch.cuda.synchronize()
        if args.barrier:  # every process of the job built its runner: the CPUs are quiet
            wait_barrier(args.barrier, f"{args.label}-{kvd}")
        lock = open(args.lock, "a+") if args.lock else None
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the measurements are done
            print(f"[{args.label}] {kvd}: measuring from {time.strftime('%H:%M:%S')}",
                  flush=True)
        rec = {"label": args.label, "kv_dtype": kvd, "backend": runner.backend_name,
               "page_size": runner.pool.page_size, "startup_s": time.time() - t0,
               "points": []}
        kv_per_tok = sum(t[0].numel() * t.element_size() for t in  # one page of each layer
                         (*runner.pool.k_caches, *runner.pool.v_caches)) // runner.pool.page_size
        for b, ctx in points:
            runs = [seed.decode_point(runner, b, ctx, args.steps) for _ in range(args.repeats)]
            pt = {"batch": b, "context": ctx, "tok_s": statistics.median(runs), "runs": runs}
            if b == 1:
                pt["roofline_tok_s"] = bw / (runner.weight_bytes + kv_per_tok * ctx)
                pt["pct"] = 100 * pt["tok_s"] / pt["roofline_tok_s"]
            rec["points"].append(pt)
            print(f"[{args.label}] {kvd} b={b} ctx={ctx}: {pt['tok_s']:.1f} tok/s "
                  f"(runs {', '.join(f'{r:.0f}' for r in runs)})"
                  + (f" {pt['pct']:.1f}% of {pt['roofline_tok_s']:.0f}" if b == 1 else ""),
                  flush=True)
            if args.overlapped and runner.graphs is not None and runner.graphs.can_run(b):
                ov = [decode_overlapped(runner, b, ctx, args.steps) for _ in range(args.repeats)]
                pt["overlapped_tok_s"] = statistics.median(ov)
                print(f"[{args.label}] {kvd} b={b} ctx={ctx}: {pt['overlapped_tok_s']:.1f} tok/s "
                      f"without a sync per step"
                      + (f" ({100 * pt['overlapped_tok_s'] / pt['roofline_tok_s']:.1f}%)"
                         if b == 1 else ""), flush=True)
        rec.update(host_and_gpu_times(runner, 1024))
        print(f"[{args.label}] {kvd} host graphs.run {rec['host_graphs_run_us']:.0f} us, "
              f"host head+argmax {rec['host_head_argmax_us']:.0f} us, "
              f"GPU replay alone {rec['gpu_replay_us']:.0f} us", flush=True)
        trace = (os.path.join(args.trace_dir, f"trace_{args.label}_{kvd}.json")
                 if args.trace_dir else None)
        rec["profile"] = profile_step(runner, 1024, trace)
        pr = rec["profile"]
        print(f"[{args.label}] {kvd} profile b=1 ctx=1024: {pr['kernels_per_step']:.0f} "
              f"kernels/step, GPU {pr['gpu_kernel_us_per_step']:.0f} us/step", flush=True)
        for t in pr["top"]:
            print(f"     {t['per_step']:6.1f}/step {t['us_each']:7.1f} us  {t['name']}")
        if lock is not None:
            lock.close()  # releases the flock
        print("RESULT " + json.dumps(rec), flush=True)
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
