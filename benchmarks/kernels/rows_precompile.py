"""Compile rows_gemm variants (kernels/rows_gemm.py) in parallel processes, filling Triton's disk
cache before a GPU job times or tests them: a fresh GPU machine compiles each (tile, variant)
in seconds, one after the other in a single process, and its CPU cores sit idle meanwhile.

A variant's binary depends on the tile, the fused parts and the integer arguments' divisibility
(every shape of a Llama-family decoder is a multiple of 16), not on N, K or M, so one small
product per (tile, variant) compiles what the real shapes run.

Usage: python3 rows_precompile.py --tiles "16,16,256,4,4;64,64,64,4,3" [--variants
       plain,f32,norm,norm_add,gated] [--workers 12] [--pdl off|on|off,on]
       python3 rows_precompile.py --model-shapes [--pdl off,on]   (the tiles rows_config picks for
       Qwen3-1.7B's shapes and the test models')
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

VARIANTS = ("plain", "f32", "norm", "norm_add", "gated")


def compile_one(task) -> float:
    """Runs one small product of ``task = (tile, variant, k, pdl)``; returns its seconds."""
    tile, variant, k, pdl_on = task
    t0 = time.time()
    import torch

    from kvfit.kernels import pdl
    from kvfit.kernels.rows_gemm import rows_gemm

    pdl.ENABLED = pdl_on
    dev = torch.device("cuda")
    dt = torch.bfloat16
    n = 256
    x = torch.randn(3, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt)
    nw = torch.randn(k, device=dev, dtype=dt)
    r = torch.randn(3, k, device=dev, dtype=dt)
    if variant == "plain":
        rows_gemm(x, w, config=tile)
    elif variant == "f32":
        rows_gemm(x, w, out_dtype=torch.float32, config=tile)
    elif variant == "norm":
        rows_gemm(x, w, norm=(nw, 1e-6, 0.0), config=tile)
    elif variant == "norm_add":
        rows_gemm(x, w, norm=(nw, 1e-6, 0.0), residual=r, config=tile)
    elif variant == "gated":
        rows_gemm(x, w, norm=(nw, 1e-6, 0.0), residual=r, gated_act="silu", config=tile)
    else:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    torch.cuda.synchronize()
    return time.time() - t0


def safe_compile_one(task):
    """``compile_one``, or the error's text (a tile over the shared memory, ...)."""
    try:
        return compile_one(task)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:160]}"


def precompile(tasks, workers: int) -> float:
    """Runs ``compile_one`` over ``tasks`` in ``workers`` spawned processes; wall seconds."""
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(tasks))) as pool:
        for task, res in zip(tasks, pool.map(safe_compile_one, tasks, chunksize=1)):
            if isinstance(res, str):
                print(f"{task}: {res}", flush=True)
    return time.time() - t0


def model_tasks(pdl_on: bool, k: int = 2048) -> list:
    """(tile, variant) of every product of a Qwen3-1.7B decode step (and the tiny test models'
    fallback tiles), as rows_config picks them."""
    from kvfit.kernels.rows_gemm import rows_config

    shapes = [(4096, 2048, False, "norm_add"), (4096, 2048, False, "norm"),
              (2048, 2048, False, "plain"), (6144, 2048, True, "gated"),
              (2048, 6144, False, "plain"), (151936, 2048, False, "f32"),
              (256, 256, False, "plain"), (256, 256, False, "norm_add"),
              (256, 256, False, "norm"), (512, 256, True, "gated"), (512, 256, False, "f32")]
    tasks = []
    for n_out, kk, gated, variant in shapes:
        t = (tuple(rows_config(n_out, kk, gated)), variant, max(kk, 512), pdl_on)
        if t not in tasks:
            tasks.append(t)
    return tasks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", default=None)
    p.add_argument("--variants", default="plain,norm_add,gated")
    p.add_argument("--model-shapes", action="store_true")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--pdl", default="off", help="off, on, or off,on: programmatic dependent "
                   "launch in the compiled variants (kernels/pdl.py)")
    args = p.parse_args()
    pdls = [v == "on" for v in args.pdl.split(",")]
    tasks = [t for on in pdls for t in model_tasks(on)] if args.model_shapes else []
    if args.tiles:
        for t in args.tiles.split(";"):
            tile = tuple(int(v) for v in t.split(","))
            for v in args.variants.split(","):
                tasks.append((tile, v, 2048, pdls[0]))
    print(f"precompiled {len(tasks)} rows_gemm variants in {precompile(tasks, args.workers):.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
