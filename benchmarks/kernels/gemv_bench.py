"""Batch-1 GEMV on the GPU: kvfit's Triton GEMV (kernels/gemv.py) against cuBLAS (F.linear) at a
decoder's per-layer shapes, in weight bytes read per second.

Each case is timed inside a CUDA graph of ``--reps`` launches over ``--copies`` weight copies
(rotated so the weights never sit in L2: 50 MB of gate_up fits the H200's L2), CUDA events,
best of 5 replays. Tiles: every (block_n, block_k, num_warps, num_stages) of ``--configs``.
Prints one table: shape, cuBLAS TB/s (+ its reduce kernel when it splits K), the best tile and
its TB/s, and the fused variants (norm prologue; gated epilogue) at the best tile.

Usage: python3 gemv_bench.py [--hidden 2048 --inter 6144 --q 2048 --kv 1024] [--configs ...]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from kvfit.kernels.gemv import gemv


def timed(fn, copies: int, reps: int) -> float:
    """Seconds per call of fn(i) (i = weight copy), from a graph of ``reps`` calls."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for r in range(reps):
                fn(r % copies)
    torch.cuda.current_stream().wait_stream(s)
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3 / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=6144)
    p.add_argument("--q", type=int, default=2048)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--configs", default="4,8,16:256,512,1024:4,8:1",
                   help="block_n list:block_k list:num_warps list:num_stages list (all products),"
                        " or ';'-separated tiles bn,bk,warps,stages")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    h, i = args.hidden, args.inter
    shapes = {"qkv": (args.q + 2 * args.kv, h), "o": (h, args.q), "gate_up": (2 * i, h),
              "down": (h, i), "lm_head": (args.vocab, h)}
    if ";" in args.configs or args.configs.count(":") == 0:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.configs.split(";")]
    else:
        bns, bks, warps, stages = ([int(v) for v in part.split(",")] for part in
                                   args.configs.split(":"))
        tiles = list(itertools.product(bns, bks, warps, stages))
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in shapes.items():
        copies = 1 if name == "lm_head" else args.copies  # 622 MB: never in L2 anyway
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
              for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nbytes = n * k * 2
        t_cublas = timed(lambda c: F.linear(x, ws[c]), copies, args.reps)
        if name == "lm_head":  # the logits as compute_logits makes them: + a float32 cast
            t_cublas = timed(lambda c: F.linear(x, ws[c]).float(), copies, args.reps)
        ref = F.linear(x, ws[0]).float()
        best, tried = None, []
        for cfg in tiles:
            if cfg[1] > k:
                continue
            try:
                y = gemv(x, ws[0], config=cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                f32 = torch.float32 if name == "lm_head" else None
                t = timed(lambda c: gemv(x, ws[c], out_dtype=f32, config=cfg), copies,
                          args.reps)
            except Exception as e:  # a tile that does not compile (registers, smem)
                print(f"  {name} {cfg}: {type(e).__name__}")
                continue
            tried.append((cfg, nbytes / t / 1e12))
            if best is None or t < best[1]:
                best = (cfg, t, err)
        cfg, t, err = best
        row = {"name": name, "n": n, "k": k, "cublas_tbs": nbytes / t_cublas / 1e12,
               "cublas_us": t_cublas * 1e6, "gemv_cfg": cfg, "gemv_tbs": nbytes / t / 1e12,
               "gemv_us": t * 1e6, "rel_err": err}
        nw_ = torch.randn(k, device=dev, dtype=torch.bfloat16)
        r = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        if name in ("qkv", "gate_up"):
            gated = "silu" if name == "gate_up" else None
            tf = timed(lambda c: gemv(x, ws[c], norm=(nw_, 1e-6, 0.0), residual=r,
                                      gated_act=gated, config=cfg), copies, args.reps)
            row["fused_us"] = tf * 1e6
            row["fused_tbs"] = nbytes / tf / 1e12
        row["tried"] = tried
        rows.append(row)
        print(f"  {name}: " + "  ".join(f"{c}:{v:.2f}" for c, v in tried))
        print(f"{name:8s} [{n}x{k}] cuBLAS {row['cublas_us']:6.1f} us {row['cublas_tbs']:.2f} TB/s"
              f" | gemv {cfg} {row['gemv_us']:6.1f} us {row['gemv_tbs']:.2f} TB/s (err {err:.1e})"
              + (f" | fused {row['fused_us']:6.1f} us {row['fused_tbs']:.2f} TB/s"
                 if "fused_us" in row else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
