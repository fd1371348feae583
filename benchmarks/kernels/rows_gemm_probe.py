"""Batch invariance and speed of the decode step's linear layers on the GPU: cuBLAS (F.linear)
against kvfit's rows_gemm (kernels/rows_gemm.py) and the batch-1 GEMV (kernels/gemv.py), at a
decoder's per-layer shapes (Qwen3-1.7B by default).

Invariance: the first rows of a fixed random x ``[Mmax, K]`` through ``x[:M]`` for every M of
``--ms``; a kernel is invariant at M when rows 0..min(M, M')-1 are bit-equal for all M, M'. For
rows_gemm also across tiles (is a row's value a function of the tile?) and through the fused
variants (residual + RMSNorm prologue, gated epilogue, float32 LM head).

Speed: each case inside a CUDA graph of ``--reps`` launches over weight copies rotated so that
they never sit in L2, CUDA events, best of 5 replays; TB/s of weight bytes read.

Prints one table per part; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvfit.kernels.gemv import gemv
from kvfit.kernels.rows_gemm import rows_config, rows_gemm


def timed(fn, copies: int, reps: int) -> float:
    """Seconds per call of fn(i) (i = weight copy), from a graph of ``reps`` calls (on the CPU,
    a check of this script: one call's host time)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn(0)
        return time.perf_counter() - t0
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


def invariant_ms(fn, x, ms):
    """The M values whose rows differ from M = 1's row 0 or from the largest M's rows."""
    outs = {m: fn(x[:m]) for m in ms}
    big = outs[max(ms)]
    bad = []
    for m in ms:
        o = outs[m]
        if not (torch.equal(o[0], outs[1][0]) and torch.equal(o, big[:m])):
            bad.append(m)
    return bad, outs


def chain(shapes: dict, hidden: int, layers: int, ms: list[int]) -> list[dict]:
    """A decode step's products without the attention: per layer qkv (norm + residual add),
    o, gate_up (norm + residual add, gated), down, each layer its own weights (never in L2),
    then the LM head; one CUDA graph, PDL off and on. us per step and TB/s of weights."""
    from kvfit.kernels import pdl

    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = [{nm: torch.randn(*shapes[nm], device=dev, dtype=dt) / shapes[nm][1] ** 0.5
           for nm in ("qkv", "o", "gate_up", "down")} for _ in range(layers)]
    head = torch.randn(*shapes["lm_head"], device=dev, dtype=dt) / hidden ** 0.5
    nw = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dt)
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw.values()) + head.numel() * 2
    out = []
    for m in ms:
        x0 = torch.randn(m, hidden, device=dev, dtype=dt)
        q_size = shapes["o"][1]

        def step():
            x, res = x0, x0
            for lw in ws:
                qkv, res = rows_gemm(x, lw["qkv"], norm=(nw, 1e-6, 0.0), residual=res)
                h = rows_gemm(qkv[:, :q_size], lw["o"])
                a, res = rows_gemm(h, lw["gate_up"], norm=(nw, 1e-6, 0.0), residual=res,
                                   gated_act="silu")
                x = rows_gemm(a, lw["down"])
            return rows_gemm(x, head, out_dtype=torch.float32)

        row = {"m": m}
        for on in (False, True):
            pdl.ENABLED = on
            row["pdl" if on else "plain"] = timed(lambda c: step(), 1, 3)
        pdl.ENABLED = False
        out.append(row)
        print(f"chain M={m}: {layers} layers + LM head, {nbytes / 1e9:.2f} GB: PDL off "
              f"{row['plain'] * 1e6:.0f} us ({nbytes / row['plain'] / 1e12:.2f} TB/s), PDL on "
              f"{row['pdl'] * 1e6:.0f} us ({nbytes / row['pdl'] / 1e12:.2f} TB/s)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=6144)
    p.add_argument("--q", type=int, default=2048)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ms", default="1,2,3,4,8,16,33,64,128,256")
    p.add_argument("--time-ms", default="1,8,64,256")
    p.add_argument("--tiles", default="16,16,256,4,4;16,16,512,4,3;16,32,256,4,4;"
                   "16,64,128,4,3;16,64,256,4,3,1;16,128,128,4,3,1;32,64,128,4,3,1",
                   help="';'-separated tiles block_m,block_n,block_k,warps,stages[,swap]")
    p.add_argument("--inv-tiles", default=None,
                   help="tiles of the across-tiles check (default: --tiles)")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--layers", type=int, default=28, help="chain part: decoder layers")
    p.add_argument("--chain-ms", default="1,64", help="chain part: batch rows")
    p.add_argument("--precompile-workers", type=int, default=0,
                   help="compile every tile's variants first in this many processes")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--parts", default="inv,time,chain")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: the invariance part under "
                   "TRITON_INTERPRET=1 on small shapes (a check of this script)")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    dt = torch.bfloat16
    h, i = args.hidden, args.inter
    shapes = {"qkv": (args.q + 2 * args.kv, h), "o": (h, args.q), "gate_up": (2 * i, h),
              "down": (h, i), "lm_head": (args.vocab, h)}
    ms = [int(v) for v in args.ms.split(",")]
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    inv_tiles = ([tuple(int(v) for v in t.split(",")) for t in args.inv_tiles.split(";")]
                 if args.inv_tiles else tiles)
    res = {"inv": {}, "time": []}
    t0 = time.time()
    if args.precompile_workers and dev.type == "cuda":
        from rows_precompile import precompile

        tasks = [(t, v, 2048, False) for t in tiles for v in ("plain", "norm_add", "gated")]
        tasks += [(tuple(rows_config(n, k, False)), "f32", 2048, False)
                  for n, k in [shapes["lm_head"]]]
        print(f"precompiled {len(tasks)} variants in "
              f"{precompile(tasks, args.precompile_workers):.1f} s", flush=True)
    if "inv" in args.parts:
        print("== invariance: M values whose rows differ (from M=1's row 0 or the largest M's "
              "rows) ==")
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            x = torch.randn(max(ms), k, device=dev, dtype=dt)
            r = torch.randn(max(ms), k, device=dev, dtype=dt)
            nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dt)
            cases = {"cublas": lambda a: F.linear(a, w)}
            if name == "lm_head":
                cases["cublas_f32"] = lambda a: F.linear(a, w).float()
                cases["rows_f32"] = lambda a: rows_gemm(a, w, out_dtype=torch.float32)
            if name in ("qkv", "gate_up"):
                gated = "silu" if name == "gate_up" else None
                cases["rows_norm"] = lambda a, t=None: torch.cat(rows_gemm(
                    a, w, norm=(nw, 1e-6, 0.0), residual=r[:a.shape[0]], gated_act=gated,
                    config=t), 1)
            cases["rows"] = lambda a, t=None: rows_gemm(a, w, config=t)
            line = {}
            for cname, fn in cases.items():
                bad, outs = invariant_ms(fn, x, ms)
                line[cname] = bad
                if cname in ("rows", "rows_norm"):  # across tiles: a row a function of the tile?
                    ref = outs[max(ms)]
                    tile_bad = []
                    for t in inv_tiles:
                        try:
                            o = fn(x, t)
                        except Exception as e:
                            tile_bad.append(f"{t}:failed {type(e).__name__}")
                            continue
                        if not torch.equal(o, ref):
                            diff = (o.float() - ref.float()).abs().max().item()
                            tile_bad.append(f"{t}:{diff:.2e}")
                    line[f"{cname}_tiles_differ"] = tile_bad
                    if (cname == "rows" and k == h and n <= 16384
                            and dev.type == "cuda"):  # the GEMV's row 0 against ours
                        line["gemv_eq_rows"] = bool(torch.equal(gemv(x[:1], w)[0], ref[0]))
            res["inv"][name] = line
            print(f"{name:8s} {n}x{k}: " + "; ".join(f"{c}={v}" for c, v in line.items()),
                  flush=True)
        print(f"(invariance part {time.time() - t0:.1f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
    if "time" in args.parts:
        tms = [int(v) for v in args.time_ms.split(",")]
        print("== speed: TB/s of weights read (us per call) ==")
        for name, (n, k) in shapes.items():
            copies = 1 if name == "lm_head" else args.copies
            ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
            nbytes = n * k * 2
            for m in tms:
                x = torch.randn(m, k, device=dev, dtype=dt)
                row = {"shape": name, "m": m}
                row["cublas"] = timed(lambda c: F.linear(x, ws[c]), copies, args.reps)
                if m == 1 and dev.type == "cuda":
                    row["gemv"] = timed(lambda c: gemv(x, ws[c]), copies, args.reps)
                row["rows_default"] = timed(lambda c: rows_gemm(x, ws[c]), copies, args.reps)
                best = None
                for t in tiles:
                    if t[0] == 16 and m > 64:  # 16-row tiles re-read W per 16 rows
                        continue
                    try:
                        s = timed(lambda c: rows_gemm(x, ws[c], config=t), copies, args.reps)
                    except Exception as e:  # e.g. a tile over the shared memory
                        print(f"  tile {t} failed: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    row[f"rows{t}"] = s
                    if best is None or s < best[1]:
                        best = (t, s)
                row["best_tile"] = best[0]
                if name in ("qkv", "gate_up"):  # the layer's fused variant at the best tile
                    r = torch.randn(m, k, device=dev, dtype=dt)
                    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dt)
                    gated = "silu" if name == "gate_up" else None
                    row["fused_best"] = timed(lambda c: rows_gemm(
                        x, ws[c], norm=(nw, 1e-6, 0.0), residual=r, gated_act=gated,
                        config=best[0]), copies, args.reps)
                res["time"].append(row)
                tb = {kk: nbytes / v / 1e12 for kk, v in row.items()
                      if isinstance(v, float)}
                print(f"{name:8s} M={m:<4d} cublas {tb['cublas']:.2f}"
                      + (f" gemv {tb['gemv']:.2f}" if "gemv" in tb else "")
                      + f" rows(default {tuple(rows_config(n, k, False))}) "
                      f"{tb['rows_default']:.2f} best {best[0]} {nbytes / best[1] / 1e12:.2f}"
                      + (f" fused {tb['fused_best']:.2f}" if "fused_best" in tb else "")
                      + f" ({best[1] * 1e6:.1f} us; cublas {row['cublas'] * 1e6:.1f} us)",
                      flush=True)
        print(f"(speed part done at {time.time() - t0:.1f} s)", flush=True)
    if "chain" in args.parts and dev.type == "cuda":
        if res["time"]:  # the chain runs each product at the best tile the sweep found
            from kvfit.kernels import rows_gemm as rows_mod

            for name, (n, k) in shapes.items():
                key = (n // 2, k, True) if name == "gate_up" else (n, k, False)
                rows_mod.ROWS_CONFIG[key] = [(r["m"], r["best_tile"]) for r in res["time"]
                                             if r["shape"] == name]
        res["chain"] = chain(shapes, h, args.layers, [int(v) for v in args.chain_ms.split(",")])
    print(f"(total {time.time() - t0:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
