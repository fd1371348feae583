"""Time the old per-row sampler against the batched one (``kvfit.engine.sampling``).

    PYTHONPATH=src python3 benchmarks/kernels/sampler_bench.py [--device cuda] [--batch 256]
        [--vocab 151936] [--min-run 1.0] [--fused-vs-ops]

Each row of the table is one sampling workload on random logits [batch, vocab] (float32,
scale 3): per step, the old sampler's call (per-row loop, one .item() per sampled row, a
full-vocabulary log_softmax always) against the new one's ``SamplingBatch.build`` + ``sample`` +
the one ``.tolist()`` of the ids (what the engine does per step). torch.utils.benchmark times
each (it synchronises CUDA). Prints a markdown table and the speed-up.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.utils.benchmark as tb

from kvfit.engine.sampling import SamplingBatch, sample
from kvfit.sampling_params import SamplingParams


# -- the sampler as it was at 5db1fa0 (engine/sampler.py), kept here as the baseline ---------------
def _old_filter(logits, p):
    x = logits / p.temperature
    if p.top_k not in (-1, 0) and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    return x


def old_sample(logits, params, generators):
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(_old_filter(logits[i].float(), p), -1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out, logprobs


WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.6": dict(temperature=0.6),
    "T 0.7, top_k 50, top_p 0.95": dict(temperature=0.7, top_k=50, top_p=0.95),
    "T 0.8, top_p 0.95 (full sort)": dict(temperature=0.8, top_p=0.95),
    "T 1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "T 0.6 + logprobs 5": dict(temperature=0.6, logprobs=5),
}


def fused_vs_ops(args, dev) -> None:
    """The CUDA draw (kernels/sampling.py) against the torch ops (``sampler.FUSED = False``):
    kernel time per step (torch.profiler, 10 steps), host time of ``build`` and ``sample``."""
    from kvfit.engine.sampling import sampler as sampler_mod

    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=dev, generator=g) * 3
    print("| workload | draw | kernels us/step | host build us | host sample us |\n"
          "|---|---|---:|---:|---:|")
    for name, kw in WORKLOADS.items():
        if args.only and args.only not in name:
            continue
        params = [SamplingParams(**kw) for _ in range(args.batch)]
        seeds, positions = list(range(args.batch)), [100] * args.batch
        for fused in (True, False):
            sampler_mod.FUSED = fused
            b = SamplingBatch.build(params, seeds, positions, args.vocab, dev)
            for _ in range(3):
                sample(logits, b)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    sample(logits, b)
                torch.cuda.synchronize()
            gpu = sum(e.device_time for e in p.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA) / 10
            host = {}
            for what, fn in (("build", lambda: SamplingBatch.build(params, seeds, positions,
                                                                    args.vocab, dev)),
                             ("sample", lambda: sample(logits, b))):
                t = time.perf_counter()
                for _ in range(20):
                    fn()
                host[what] = (time.perf_counter() - t) / 20 * 1e6
                torch.cuda.synchronize()
            print(f"| {name} | {'fused' if fused else 'torch ops'} | {gpu:.1f} | "
                  f"{host['build']:.0f} | {host['sample']:.0f} |", flush=True)
    sampler_mod.FUSED = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--min-run", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--only", default=None, help="run the workloads whose name contains this")
    ap.add_argument("--skip-old", action="store_true", help="time the new sampler only")
    ap.add_argument("--fused-vs-ops", action="store_true",
                    help="CUDA: the fused draw against the torch ops, kernel and host time")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.fused_vs_ops:
        if dev.type != "cuda":
            raise SystemExit("--fused-vs-ops compares the CUDA draw: it needs a GPU")
        fused_vs_ops(args, dev)
        return
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=dev, generator=g) * 3
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"batch {args.batch} x vocab {args.vocab}, torch {torch.__version__}\n")
    print("| workload | old ms/step | new ms/step | speed-up |\n|---|---:|---:|---:|")
    for name, kw in WORKLOADS.items():
        if args.only and args.only not in name:
            continue
        params = [SamplingParams(**kw) for _ in range(args.batch)]
        seeds = list(range(args.batch))
        positions = [1000 + i for i in range(args.batch)]

        def new():
            batch = SamplingBatch.build(params, seeds, positions, args.vocab, dev)
            return sample(logits, batch).token_ids.tolist()

        def old():
            gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
            return old_sample(logits, params, gens)[0]

        t_new = tb.Timer("f()", globals={"f": new}).blocked_autorange(min_run_time=args.min_run)
        if args.skip_old:
            print(f"| {name} | - | {t_new.median * 1e3:.2f} | - |", flush=True)
            continue
        t_old = tb.Timer("f()", globals={"f": old}).blocked_autorange(min_run_time=args.min_run)
        print(f"| {name} | {t_old.median * 1e3:.2f} | {t_new.median * 1e3:.2f} | "
              f"{t_old.median / t_new.median:.1f}x |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
