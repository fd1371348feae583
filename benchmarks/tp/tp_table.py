"""Issue 16's table from two ``kvfit bench seed`` runs of the same model, one at TP=1 and one
at TP=N (their ``seed.json``): per KV dtype, batch-1 decode at the shortest context, batch-64
decode at every context (the target is the longest; a shorter one gives a ratio where one GPU
cannot hold the longest), and KV tokens (at the fixed per-GPU budget and at the card's ratio), TP=N against
TP=1, with the issue's targets (1.6x, 1.7x, 2x).

    python3 benchmarks/tp/tp_table.py OUT/tp1/seed.json OUT/tp2/seed.json
"""

from __future__ import annotations

import json
import sys

TARGETS = {"decode b=1": 1.6, "decode b=64": 1.7, "KV tokens": 2.0}


def _decode(rec: dict, batch: int, context: int):
    for p in rec["decode"]:
        if p["batch"] == batch and p["context"] == context:
            return p.get("tok_s")
    return None


def rows(one: dict, many: dict) -> list[tuple]:
    """(metric, kv dtype, TP=1 value, TP=N value, ratio or None, target) per row."""
    out = []
    by_dtype = {r["kv_dtype"]: r for r in one["dtypes"]}
    for r in many["dtypes"]:
        base = by_dtype.get(r["kv_dtype"])
        if base is None:
            continue
        contexts = sorted({p["context"] for p in r["decode"]})
        points = [("decode b=1", 1, contexts[0])] + [("decode b=64", 64, c) for c in contexts]
        for name, b, ctx in points:
            a, n = _decode(base, b, ctx), _decode(r, b, ctx)
            out.append((f"{name} ctx {ctx} (tok/s)", r["kv_dtype"], a, n,
                        n / a if a and n else None, TARGETS[name]))
        for key, label in (("budget_tokens_fixed", f"KV tokens, {one['budget_gib']:.2f} GiB/GPU"),
                           ("budget_tokens_card", "KV tokens, card's ratio")):
            a, n = base[key], r[key]
            out.append((label, r["kv_dtype"], a, n, n / a if a else None, TARGETS["KV tokens"]))
    return out


def markdown(one: dict, many: dict) -> str:
    tp = many.get("tensor_parallel_size", "N")
    lines = [f"| metric | kv dtype | TP=1 | TP={tp} | TP={tp} / TP=1 | target |",
             "|---|---|---:|---:|---:|---:|"]
    for metric, kvd, a, n, ratio, target in rows(one, many):
        fmt = (lambda v: "does not fit" if v is None else f"{v:,.0f}")
        verdict = "" if ratio is None else (" met" if ratio >= target else " missed")
        lines.append(f"| {metric} | {kvd} | {fmt(a)} | {fmt(n)} | "
                     + ("-" if ratio is None else f"{ratio:.2f}x") + f" | >= {target}x{verdict} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        one = json.load(f)
    with open(argv[1]) as f:
        many = json.load(f)
    print(markdown(one, many))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
