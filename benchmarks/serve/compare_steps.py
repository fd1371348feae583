"""Compare two engine step logs (``kvfit bench serve --step-log``: PREFIX.server.json and
PREFIX.offline.json, or any two ``StepTimer`` dumps): totals, the decode-only step time, how
full the batches were, and a timeline of both runs in buckets.

    python3 benchmarks/serve/compare_steps.py steps.server.json steps.offline.json --bucket-ms 250
"""

from __future__ import annotations

import argparse
import json
import statistics


def load(path: str, skip_warmup: bool) -> list:
    rows = json.load(open(path))["rows"]
    if skip_warmup:
        for i, r in enumerate(rows):
            if r[6] and i + 1 < len(rows):
                return rows[i + 1:]
    return rows


def describe(name: str, rows: list, bucket_s: float) -> None:
    t0 = rows[0][0]
    span = rows[-1][0] + rows[-1][1] - t0
    busy = sum(r[1] for r in rows)
    dec_only = sorted(r[1] for r in rows if r[3] == 0 and r[2] > 0)
    mixed = sorted(r[1] for r in rows if r[3] > 0)
    gaps = [rows[i + 1][0] - rows[i][0] - rows[i][1] for i in range(len(rows) - 1)]
    full = max(r[4] for r in rows)
    print(f"== {name}: {len(rows)} steps over {span:.3f} s, inside step() {busy:.3f} s, between "
          f"steps {sum(gaps):.3f} s (median gap {1e3 * statistics.median(gaps):.3f} ms)")
    print(f"   decode-only steps {len(dec_only)}: median {1e3 * dec_only[len(dec_only) // 2]:.2f} ms,"
          f" mean {1e3 * statistics.fmean(dec_only):.2f}; steps with prefill {len(mixed)}: "
          f"median {1e3 * mixed[len(mixed) // 2] if mixed else 0:.1f} ms, total "
          f"{sum(mixed):.3f} s, {sum(r[3] for r in rows)} tokens")
    print(f"   decode rows {sum(r[2] for r in rows)}; steps at {full} running: "
          f"{sum(1 for r in rows if r[4] == full)}, mean running {statistics.fmean(r[4] for r in rows):.1f},"
          f" mean waiting {statistics.fmean(r[5] for r in rows):.1f}")
    print("   timeline (per bucket: steps, decode rows, prefill tokens, mean running):")
    b, line = 0, []
    while t0 + b * bucket_s < rows[-1][0]:
        lo, hi = t0 + b * bucket_s, t0 + (b + 1) * bucket_s
        sel = [r for r in rows if lo <= r[0] < hi]
        if sel:
            line.append(f"{len(sel)}/{sum(r[2] for r in sel)}/{sum(r[3] for r in sel)}/"
                        f"{statistics.fmean(r[4] for r in sel):.0f}")
        else:
            line.append("-")
        b += 1
    for i in range(0, len(line), 8):
        print("   " + "  ".join(line[i:i + 8]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("server")
    p.add_argument("offline")
    p.add_argument("--bucket-ms", type=float, default=250)
    a = p.parse_args()
    describe("server", load(a.server, True), a.bucket_ms / 1e3)
    describe("offline", load(a.offline, False), a.bucket_ms / 1e3)


if __name__ == "__main__":
    main()
