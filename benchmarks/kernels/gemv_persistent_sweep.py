"""Persistent GEMV tiles against the classic grid (``kernels/gemv.py``), one decoder product at a
time at M = 1: for each product of a model (qkv with the norm prologue, o, gate/up with norm and
gated epilogue, down, the float32 LM head), the module's tile on the classic grid (one program
per output block) and persistent tiles (``config[4]`` = blocks per program: about 132 or 264
programs walking their blocks in one pipelined loop), weights rotated over copies so they never
sit in L2 (``gemv_bench.timed``: a CUDA graph of launches, best of 5 replays). Every persistent
output is checked bit-equal to the classic kernel's at the same tile.

Usage: python3 gemv_persistent_sweep.py [--model CONFIG.json] [--programs 132,264]
       [--stages 3,4,6] [--json F]
Prints one table: product, classic tile and us, best persistent tile and us, its TB/s and the
ratio; ``--json`` writes the best tile per product in the form ``gemv_rows_bench.py --tiles``
reads (the classic tile where no persistent one is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import timed  # noqa: E402
from gemv_rows_sweep import MODEL, call, product_inputs, products, try_tile  # noqa: E402

from kvfit.kernels.gemv import gemv_config  # noqa: E402


def candidates(n_out: int, k: int, gated: bool, programs, stages) -> list[tuple]:
    out = []
    for bn in ((4, 8) if gated else (4, 8, 16)):
        for bk in ((256, 512) if k > 4096 else (512,)):
            blocks = -(-n_out // bn)
            for p in programs:
                per = max(1, -(-blocks // p))
                for st in stages:
                    t = (bn, bk, 4, st, per)
                    if t not in out:
                        out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--programs", default="132,264")
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = json.load(open(args.model))
    programs = [int(v) for v in args.programs.split(",")]
    stages = [int(v) for v in args.stages.split(",")]
    torch.manual_seed(0)
    best = {}
    print("| product | classic tile | classic us | best persistent tile | us | TB/s | "
          "/ classic | tried |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, (n, k, kind) in products(cfg).items():
            gated = kind == "gated"
            n_out = n // 2 if gated else n
            ws, nw, x, r = product_inputs(n, k, args.copies, 1)
            nbytes = n * k * 2
            classic = gemv_config(n_out, k, gated, 1)[:4]
            ref = call(kind, x, ws[0], nw, r, classic, 1)
            t_classic = timed(lambda c: call(kind, x, ws[c], nw, r, classic, 1), len(ws),
                              args.reps)
            found, tried = None, 0
            for tile in candidates(n_out, k, gated, programs, stages):
                t = try_tile(f"{name} {tile}", lambda c: call(kind, x, ws[c], nw, r, tile, 1),
                             len(ws), args.reps)
                if t is None:
                    continue
                tried += 1
                # at the classic tile's (block_n, block_k) the persistent grid must give its bits
                same = tile[:2] != classic[:2] or torch.equal(
                    call(kind, x, ws[0], nw, r, tile, 1), ref)
                print(f"  {name} {tile}: {t * 1e6:.2f} us"
                      + ("" if same else "  NOT BIT-EQUAL to the classic tile"), flush=True)
                if same and (found is None or t < found[1]):
                    found = (tile, t)
            tile, t = found if found and found[1] < t_classic else (classic, t_classic)
            best[name] = {"1": {"n_out": n_out, "k": k, "gated": gated, "tile": list(tile),
                                "us_m1": t * 1e6, "classic_us": t_classic * 1e6}}
            t_best = found[1] if found else t_classic
            print(f"| {name} | {classic} | {t_classic * 1e6:.2f} | {found and found[0]} | "
                  f"{t_best * 1e6:.2f} | {nbytes / t_best / 1e12:.2f} | {t_best / t_classic:.3f} "
                  f"| {tried} |", flush=True)
            del ws
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
