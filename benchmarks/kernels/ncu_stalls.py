"""Where a kernel's warps wait, instruction by instruction: reads the per-instruction table that
``ncu -i REPORT --page source --csv --print-source sass`` exports (a report collected with
``--section WarpStateStats --section SourceCounters``) and prints one table: each stall reason's
share of all warp-stall samples, then the instructions with the most samples and their two main
reasons. This is how the twenty-third session found that the register MLA decode waited on its
softmax maximum's shuffles queued behind the next tile's loads (docs/benchmarks.md).

    ncu --section WarpStateStats --section SourceCounters -k regex:NAME -c 1 -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 benchmarks/kernels/ncu_stalls.py rep.csv [--top 20]
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """(stall columns, instruction rows) of an ncu source-page CSV: the header is the first row
    that names ``Address`` and ``Source``; rows of another length (kernel-name lines) are
    skipped. Stall columns are the ``stall_*`` counts of all samples (not the "Not Issued")."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if "Address" in row and "Source" in row:
            header = row
            break
    else:
        raise ValueError(f"{path}: no 'Address'/'Source' header: export it with --page source "
                         f"--csv --print-source sass")
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    data = [dict(zip(header, r)) for r in rows[i + 1:] if len(r) == len(header)]
    return stalls, data


def summarize(stalls: list[str], data: list[dict[str, str]], top: int = 15):
    """(total samples, [(reason, share)] descending, [(samples, share, source, [(n, reason)
    x2])] for the ``top`` instructions by samples)."""
    totals = {s: sum(_number(r.get(s, "")) for r in data) for s in stalls}
    total = sum(totals.values()) or 1.0
    reasons = sorted(((s[len("stall_"):], v / total) for s, v in totals.items()),
                     key=lambda x: -x[1])
    rows = sorted(data, key=lambda r: -_number(r.get(SAMPLES, "")))[:top]
    hot = []
    for r in rows:
        n = _number(r.get(SAMPLES, ""))
        why = sorted(((_number(r.get(s, "")), s[len("stall_"):]) for s in stalls),
                     reverse=True)[:2]
        hot.append((n, n / total, r.get("Source", "").strip(), why))
    return total, reasons, hot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    total, reasons, hot = summarize(*read_source_csv(args.csv), top=args.top)
    print(f"{total:.0f} warp-stall samples: " + ", ".join(
        f"{name} {100 * share:.1f}%" for name, share in reasons[:9] if share > 0))
    print("| samples | share | instruction | main reasons |")
    print("|---:|---:|---|---|")
    for n, share, src, why in hot:
        reasons_txt = ", ".join(f"{name} {v:.0f}" for v, name in why if v > 0)
        print(f"| {n:.0f} | {100 * share:.1f}% | `{src[:60]}` | {reasons_txt} |")


if __name__ == "__main__":
    main()
