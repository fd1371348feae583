"""Markdown tables from ``kvfit bench kernels`` JSON: python tables.py kernels.json [decode|prefill]"""

import json
import sys

d = json.load(open(sys.argv[1]))
kind = sys.argv[2] if len(sys.argv) > 2 else "decode"
rows = {}
for r in d["results"]:
    if r["kind"] == kind:
        rows[(r["layout"], r["batch"], r["context"], r["kv_dtype"])] = r
bw = d["meta"]["copy_bw_bytes_per_s"] / 1e12


def f(x, fmt):
    return fmt.format(x) if x is not None else "-"


if kind == "decode":
    print(f"copy bandwidth {bw:.2f} TB/s. µs / TB/s (% of copy) per kernel; el/s = KV elements/s.\n")
    print("| heads | batch | ctx | bf16 ours | bf16 FI | fp8 ours | fp8 FI | fp8 ours el/s |"
          " fp8/bf16 ours | fp8/bf16 FI |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (lay, b, c, kvd), r in sorted(rows.items()):
        if kvd != "fp8_e4m3":
            continue
        o = rows.get((lay, b, c, "bfloat16"), {})
        cell = lambda x, w: (f"{x[w + '_us']:.1f} / {x[w + '_tbps']:.2f} ({x[w + '_pct_copy']:.0f}%)"
                             if w + "_us" in x else "-")
        sp = lambda w: (f"{o[w + '_us'] / r[w + '_us']:.2f}x" if w + "_us" in o and w + "_us" in r
                        else "-")
        print(f"| {lay} | {b} | {c} | {cell(o, 'ours')} | {cell(o, 'fi')} | {cell(r, 'ours')} | "
              f"{cell(r, 'fi')} | {r['ours_elem_per_s']:.2e} | {sp('ours')} | {sp('fi')} |")
else:
    print("| heads | KV | batch x len | page | ours µs | ours TFLOP/s | FI fa2 µs | FI TFLOP/s |"
          " ours/FI time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (lay, b, c, kvd), r in sorted(rows.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][3])):
        ratio = r["ours_us"] / r["fi_us"] if "fi_us" in r else None
        print(f"| {lay} | {kvd} | {b} x {c} | {r.get('page_size', '-')} | {r['ours_us']:.0f} | "
              f"{r['ours_tflops']:.0f} | {f(r.get('fi_us'), '{:.0f}')} | "
              f"{f(r.get('fi_tflops'), '{:.0f}')} | {f(ratio, '{:.2f}')} |")
