"""The GPU round's short table from its result files (serve.json of ``kvfit bench serve``,
probe_profile.json of profile_probe.py): server vs offline, and the cached-prefix probe."""

import json
import os
import sys


def main(out_dir: str) -> None:
    rows = []
    serve = os.path.join(out_dir, "serve.json")
    probe = os.path.join(out_dir, "probe_profile.json")
    off = None
    if os.path.exists(probe):
        p = json.load(open(probe))
        off = p.get("offline_serve")
    if os.path.exists(serve):
        s = json.load(open(serve))
        if off is None and "offline" in s:  # kvfit bench serve --offline
            o = s["offline"]
            off = {"output_tok_s": o["output_throughput"], "steps": s.get("steps", {}).get(
                "offline", {"steps": 0, "decode_step_median_ms": 0.0})}
        rows.append(("server output tok/s", f"{s['output_throughput']:.0f}"))
        if off:
            rows.append(("offline output tok/s (same requests, max_num_seqs 64)",
                         f"{off['output_tok_s']:.0f}"))
            rows.append(("server / offline", f"{s['output_throughput'] / off['output_tok_s']:.1%}"))
        for k, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
            rows.append((f"{name} median / p99 ms", f"{s[k]['median']:.2f} / {s[k]['p99']:.2f}"))
        if "client_cpu_s" in s:
            rows.append(("load generator CPU / wall", f"{s['client_cpu_s']:.2f} / "
                                                      f"{s['duration_s']:.2f} s"))
        st = s.get("steps", {}).get("server")
        if st:
            rows.append(("server engine: steps, decode-step median ms",
                         f"{st['steps']}, {st['decode_step_median_ms']:.2f}"))
    if off:
        rows.append(("offline engine: steps, decode-step median ms",
                     f"{off['steps']['steps']}, {off['steps']['decode_step_median_ms']:.2f}"))
    if os.path.exists(probe):
        p = json.load(open(probe))
        pr = p.get("probe_median")
        if pr:
            rows.append(("probe TTFT uncached / cached ms",
                         f"{pr['uncached_ttft_ms']:.2f} / {pr['cached_ttft_ms']:.2f}"))
            rows.append(("probe cached / uncached", f"{pr['ratio']:.3f}"))
        for k in ("random_0", "random_1"):
            if k in p:
                rows.append((f"{k} TTFT median / p99 ms",
                             f"{p[k]['ttft_median_ms']:.1f} / {p[k]['ttft_p99_ms']:.1f}"))
    w = max((len(a) for a, _ in rows), default=10)
    print("| " + "metric".ljust(w) + " | value |")
    print("|" + "-" * (w + 2) + "|---|")
    for a, b in rows:
        print(f"| {a.ljust(w)} | {b} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
