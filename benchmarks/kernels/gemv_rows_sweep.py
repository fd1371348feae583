"""Tiles of the GEMV (``kernels/gemv.py``) per decoder product and rows per program (BLOCK_M):
for each product of a model (qkv with the norm prologue, o, gate/up with norm and gated epilogue,
down, the float32 LM head), each block_m and each tile, the time of one product at M = 1 and at
M = block_m, weights rotated over copies so they never sit in L2 (``gemv_bench.timed``: a CUDA
graph of launches, best of 5 replays). The best tile per (product, block_m) minimises
t(M = 1) + t(M = block_m).

Usage: python3 gemv_rows_sweep.py [--model CONFIG.json] [--block-ms 1,2,4,8] [--json F]
Prints one table: product, block_m, best tile, us at M = 1 and at M = block_m, TB/s at M = 1;
``--json`` writes the best tiles in the form ``gemv_rows_bench.py --tiles`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import timed  # noqa: E402

from kvfit.kernels.gemv import gemv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "..", "src", "kvfit", "bench", "configs", "qwen3-1.7b.json")
TILES = {1: "8,256,4,4;4,512,4,4;8,512,4,3;16,256,4,3;4,256,4,4",
         2: "8,256,4,3;4,256,4,4;8,128,4,4;4,512,4,3;16,128,4,3",
         4: "8,128,4,4;4,256,4,4;8,256,4,3;4,128,4,4;16,64,4,4;8,256,8,3",
         8: "4,128,4,4;8,64,4,4;4,64,4,4;8,128,8,3;4,256,8,3"}


def products(cfg: dict) -> dict:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, h, "norm"), "o": (h, q, "plain"),
            "gate_up": (2 * inter, h, "gated"), "down": (h, inter, "plain"),
            "lm_head": (cfg["vocab_size"], h, "f32")}


def call(kind, x, w, nw, r, cfg, bm):
    if kind == "norm":
        return gemv(x, w, norm=(nw, 1e-6, 0.0), residual=r, config=cfg, block_m=bm)[0]
    if kind == "gated":
        return gemv(x, w, norm=(nw, 1e-6, 0.0), residual=r, gated_act="silu", config=cfg,
                    block_m=bm)[0]
    if kind == "f32":
        return gemv(x, w, out_dtype=torch.float32, config=cfg, block_m=bm)
    return gemv(x, w, config=cfg, block_m=bm)


def product_inputs(n: int, k: int, copies: int, rows: int) -> tuple:
    """(weight copies [N, K], norm weight [K], x [rows, K], residual [rows, K]), bf16 on the
    GPU; fewer copies of weights too large to fit L2 twice anyway."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for _ in range(copies if n * k < 2 ** 28 else 2)]
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    rs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return ws, nw, xs, rs


def try_tile(label: str, fn, copies: int, reps: int):
    """Seconds per call of fn(copy) (``gemv_bench.timed``), or None with a line when the tile
    does not compile (resources)."""
    try:
        return timed(fn, copies, reps)
    except Exception as e:
        print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL)
    p.add_argument("--block-ms", default="1,2,4,8")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = json.load(open(args.model))
    torch.manual_seed(0)
    best = {}
    print("| product | block_m | best tile (bn,bk,warps,stages) | us at M=1 | us at M=block_m "
          "| TB/s at M=1 | tiles tried |")
    print("|---|---:|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, (n, k, kind) in products(cfg).items():
            ws, nw, xs, rs = product_inputs(n, k, args.copies, 8)
            nbytes = n * k * 2
            for bm in [int(v) for v in args.block_ms.split(",")]:
                found = None
                tried = 0
                for t in TILES[bm].split(";"):
                    tile = tuple(int(v) for v in t.split(","))
                    if kind == "gated" and tile[0] * tile[1] * bm > 4096:
                        continue  # two float32 partial-sum tiles: registers spill beyond this
                    label = f"{name} bm={bm} tile={tile}"
                    t1 = try_tile(label, lambda c: call(kind, xs[:1], ws[c], nw, rs[:1], tile,
                                                        bm), len(ws), args.reps)
                    tm = t1 and try_tile(label, lambda c: call(kind, xs[:bm], ws[c], nw,
                                                               rs[:bm], tile, bm),
                                         len(ws), args.reps)
                    if tm is None:
                        continue
                    tried += 1
                    if found is None or t1 + tm < found[1] + found[2]:
                        found = (tile, t1, tm)
                if found is None:
                    continue
                tile, t1, tm = found
                best.setdefault(name, {})[bm] = {"n_out": n // 2 if kind == "gated" else n,
                                                  "k": k, "gated": kind == "gated",
                                                  "tile": tile, "us_m1": t1 * 1e6,
                                                  "us_mbm": tm * 1e6}
                print(f"| {name} | {bm} | {tile} | {t1 * 1e6:.1f} | {tm * 1e6:.1f} | "
                      f"{nbytes / t1 / 1e12:.2f} | {tried} |", flush=True)
            del ws
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
