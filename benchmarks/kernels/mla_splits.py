"""Where the MLA decode's time goes at each split count: for each (KV dtype, batch, context)
point of the DeepSeek-V2-Lite shape and each split count (the default rule's, marked *, and the
listed ones), the call as a CUDA-graph replay (the engine's decode), and the profiler's device
time of its two kernels (the split decode and the merge); what is left is the gap between them
in the graph. One table; latent bytes over time against the measured copy bandwidth.

    python3 benchmarks/kernels/mla_splits.py --points fp8_e4m3:4:32768,bfloat16:4:32768 \
        --splits 8,16,32,64
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def kernel_us(fns, replays: int = 20) -> dict[str, float]:
    """Device µs per call of each kernel the calls ``fns`` launch, by kernel name, from
    ``torch.profiler`` over ``replays`` replays of their CUDA graph."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvfit.bench.kernels_common import capture_graph

    g = capture_graph(fns)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    calls = replays * len(fns)
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t and ev.count >= calls:
            out[ev.key] = out.get(ev.key, 0.0) + t / calls
    return out


def split_kernels(times: dict[str, float]) -> tuple[float, float]:
    """(decode µs, merge µs) from ``kernel_us``'s names (the merge kernel's name says merge)."""
    merge = sum(t for k, t in times.items() if "merge" in k)
    decode = sum(t for k, t in times.items() if "mla" in k and "merge" not in k)
    return decode, merge


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="fp8_e4m3:4:32768,bfloat16:4:32768")
    p.add_argument("--splits", default="", help="split counts besides the default rule's")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from kvfit.bench.kernels_common import copy_bandwidth, graph_us
    from kvfit.bench.kernels_mla import LatentSet, _decode_call
    from kvfit.kernels.mla import decode_config

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    print("| KV dtype | batch x context | splits | graph us | % of copy | decode us | merge us "
          "| gap us |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for point in args.points.split(","):
        kvd, b, ctx = point.split(":")
        b, ctx = int(b), int(ctx)
        ls = LatentSet(512, 64, kvd, b, ctx, 32 if kvd.startswith("fp8") else 16, "cuda")
        base = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16)
        counts = [base.num_splits] + sorted({int(s) for s in filter(None, args.splits.split(","))}
                                            - {base.num_splits})
        for s in counts:
            cfg = dataclasses.replace(base, num_splits=s)
            fns = [_decode_call(ls, args.heads, cfg, i) for i in range(ls.reps)]
            us = graph_us(fns)
            dec, mrg = split_kernels(kernel_us(fns))
            pct = 100 * ls.bytes / (us * 1e-6) / bw
            mark = "*" if s == base.num_splits else ""
            print(f"| {kvd} | {b} x {ctx} | {s}{mark} | {us:.1f} | {pct:.0f}% | {dec:.1f} | "
                  f"{mrg:.1f} | {us - dec - mrg:.1f} |", flush=True)
            rows.append({"kv_dtype": kvd, "batch": b, "context": ctx, "splits": s,
                         "default": s == base.num_splits, "graph_us": us, "pct_copy": pct,
                         "decode_us": dec, "merge_us": mrg, "cfg": str(cfg)})
        del ls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
