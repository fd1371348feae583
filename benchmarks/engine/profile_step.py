"""Where one engine step's time goes on the GPU machine (Qwen3-1.7B shape, random weights).

1. Runner decode steps through the CUDA graphs at batch 1 (context 1k) and batch 256 (context
   512): kernels per step (inside the graph), GPU kernel time per step, wall time per step.
2. One 2k-token prefill step (eager): kernels, GPU time, wall time.
3. Whole ``LLMEngine.step()`` at batch 256 and batch 1 in decode, temperature 0.6 and 0: wall time
   per step split into schedule / execute (host launch) / sample (includes waiting for the GPU) /
   append (stop checks, detokenize), from wrappers around those calls; with the overlap engine,
   launch (execute + device sampling) and process (waits for the previous step's ids + append).
Usage: python3 profile_step.py [kv_dtype] [attention_backend] [runner|engine] [on|off]
"""

import collections
import sys
import time

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.bench.configs import config_path
from kvfit.config import make_config
from kvfit.engine import llm_engine as le
from kvfit.engine.runner import ModelRunner
from kvfit.sampling_params import SamplingParams

KVD = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "triton"
MODEL = config_path("qwen3-1.7b")


def kernels_of(fn, steps=5):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by, tm = collections.Counter(), collections.Counter()
    for e in kern:
        by[e.name[:70]] += 1
        tm[e.name[:70]] += e.device_time
    tot = sum(e.device_time for e in kern) / steps
    return len(kern) / steps, tot, wall * 1e6, by, tm


def report(label, res):
    n, tot, wall, by, tm = res
    print(f"== {label}: {n:.0f} kernels/step, GPU {tot:.0f} us/step, wall {wall:.0f} us/step")
    for name, _ in sorted(tm.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {by[name] / 5:6.1f}/step {tm[name] / by[name]:7.1f} us  {name}")


def runner_points():
    cfg = make_config(model=MODEL, load_format="dummy", kv_dtype=KVD, device="cuda",
                      attention_backend=BACKEND, num_tokens=256 * 640 + 8192,
                      max_model_len=4096, max_num_seqs=256, cuda_graph_max_bs=256,
                      max_num_batched_tokens=2048)
    t = time.monotonic()
    r = ModelRunner(cfg)
    print(f"runner start {time.monotonic() - t:.1f} s (graphs {r.graphs.capture_seconds:.1f} s, "
          f"{len(r.graphs.sizes)} sizes)")
    ps = r.pool.page_size
    for bs, ctx in ((1, 1024), (256, 512)):
        per = -(-(ctx + 64) // ps)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(bs)]
        lens = [ctx] * bs
        toks = torch.randint(0, 1000, (bs,), device="cuda")
        pos = torch.full((bs,), ctx - 1, device="cuda")

        def step():
            h = r.graphs.run(toks, pos, lens, tables)
            r.model.compute_logits(h).argmax(-1)

        with torch.inference_mode():
            for _ in range(3):
                step()
            report(f"graph decode bs={bs} ctx={ctx} {KVD}", kernels_of(step))
    n = 2048
    pages = list(range(-(-n // ps)))
    meta = build_metadata([n], [n], [pages], ps, r.device)
    ids = torch.randint(0, 1000, (n,), device="cuda")
    pos = torch.arange(n, device="cuda")

    def pstep():
        r.backend.prepare(meta)
        h = r.model(ids, pos, r.ctx)
        r.model.compute_logits(h[-1:])

    with torch.inference_mode():
        for _ in range(2):
            pstep()
        report(f"prefill {n} eager {KVD}", kernels_of(pstep))
    del r
    torch.cuda.empty_cache()


def engine_points():
    times = collections.defaultdict(float)

    def wrap(obj, name, key):
        fn = getattr(obj, name)

        def w(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            times[key] += time.perf_counter() - t
            return out
        setattr(obj, name, w)

    extra = {"async_scheduling": sys.argv[4]} if len(sys.argv) > 4 else {}
    cfg = make_config(model=MODEL, load_format="dummy", kv_dtype=KVD, device="cuda",
                      attention_backend=BACKEND, max_model_len=4096, cuda_graph_max_bs=256,
                      max_num_batched_tokens=8192, **extra)
    eng = le.LLMEngine(cfg)
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.runner, "execute", "execute")
    if hasattr(eng, "_launch"):  # overlap engine: sampling at launch, outputs read in _process
        wrap(eng, "_launch", "launch")
        wrap(eng, "_process", "process")
    else:
        wrap(le, "sample", "sample")
    wrap(eng, "_append", "append")
    for bs, temp in ((256, 0.6), (256, 0.0), (1, 0.6), (1, 0.0)):
        sp = SamplingParams(temperature=temp, max_tokens=40, ignore_eos=True)
        for i in range(bs):
            eng.add_request(f"r{bs}-{temp}-{i}", list(range(1, 500)), sp)
        while min(len(r.output_token_ids) for r in eng.requests.values()) < 3:
            eng.step()  # prefill and a first decode step
        torch.cuda.synchronize()
        times.clear()
        steps = 20
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = (time.perf_counter() - t0) / steps
        parts = "  ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in times.items())
        print(f"== engine decode bs={bs} T={temp}: {wall * 1e3:.2f} ms/step, "
              f"{bs / wall:.0f} tok/s; ms/step: {parts}")
        if bs > 1:  # the kernels of whole engine steps (forward, sampler, copies)
            report(f"engine steps bs={bs} T={temp} {KVD}", kernels_of(eng.step))
        while eng.has_unfinished_requests():
            eng.step()


if sys.argv[3:4] != ["engine"]:
    runner_points()
if sys.argv[3:4] != ["runner"]:
    engine_points()
