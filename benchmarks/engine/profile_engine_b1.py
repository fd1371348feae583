"""Where a batch-1 engine step's host time goes with the fused GEMV (``--max-num-seqs 1``).

``kvfit bench latency --batch-size 1 --max-num-seqs 1`` decodes at ~95% of the model-only rate
(630 against 663 tok/s for fp8 on the H200): the host, not the GPU, may set the pace. One engine
(Qwen3-1.7B shape, random weights, default flags but ``max_num_seqs`` 1), one request of a
1,024-token prompt, then timed ``LLMEngine.step()`` calls in decode:

1. wall time per step, split by wrappers into schedule / execute / launch / process / append
   (the overlap engine's calls; each includes what it waits for);
2. the GPU kernel time per step over the same steps (torch.profiler, CUDA activity only), so
   wall - GPU is what the GPU sat idle;
3. cProfile of 100 steps: the top functions by own time and by cumulative time.

Usage: python3 benchmarks/engine/profile_engine_b1.py [kv_dtype] [temperature] [model] [device]
(model and device: a CPU smoke run with a tiny config.json)
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
import time

import torch

from kvfit.bench.configs import config_path
from kvfit.config import make_config
from kvfit.engine import llm_engine as le
from kvfit.sampling_params import SamplingParams

KVD = sys.argv[1] if len(sys.argv) > 1 else "fp8_e4m3"
TEMP = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
MODEL = sys.argv[3] if len(sys.argv) > 3 else config_path("qwen3-1.7b")
DEVICE = sys.argv[4] if len(sys.argv) > 4 else "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    cfg = make_config(model=MODEL, load_format="dummy", kv_dtype=KVD, device=DEVICE,
                      max_num_seqs=1)
    eng = le.LLMEngine(cfg)
    times = collections.defaultdict(float)
    for obj, name in ((eng.scheduler, "schedule"), (eng.runner, "execute"), (eng, "_launch"),
                      (eng, "_process"), (eng, "_append")):
        if not hasattr(obj, name):
            continue
        fn = getattr(obj, name)

        def w(*a, _fn=fn, _k=name, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            times[_k] += time.perf_counter() - t
            return out
        setattr(obj, name, w)
    sp = SamplingParams(temperature=TEMP, max_tokens=2000, ignore_eos=True)
    eng.add_request("r0", [(7 * i) % 200 + 1 for i in range(1024 if DEVICE == "cuda" else 64)], sp)
    for _ in range(30):  # prefill and warm decode steps
        eng.step()
    _sync()
    times.clear()
    steps = 200
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    parts = "  ".join(f"{k} {v / steps * 1e6:.0f}" for k, v in times.items())
    print(f"{KVD} T={TEMP}: {wall * 1e6:.0f} us/step ({1 / wall:.1f} tok/s); us/step: {parts}")
    if DEVICE == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(50):
                eng.step()
            _sync()
            pwall = (time.perf_counter() - t0) / 50
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time for e in kern) / 50
        print(f"under torch.profiler: wall {pwall * 1e6:.0f} us/step, GPU kernels {gpu:.0f} "
              f"us/step, {len(kern) / 50:.0f} kernels/step")
        by = collections.Counter()
        for e in kern:
            by[e.name[:60]] += e.device_time
        outside = [(n, t / 50) for n, t in by.most_common() if "gemv" not in n][:8]
        print("  largest non-GEMV kernels (us/step): " + ", ".join(f"{n} {t:.1f}" for n, t in outside))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        eng.step()
    _sync()
    pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(28)
        print(f"== cProfile, 100 steps, by {key}")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    eng.abort_request("r0")


if __name__ == "__main__":
    main()
