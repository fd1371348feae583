"""The batched path's products at small M (the decode steps of 1-256 requests) under cuBLAS
settings a process can choose: how close ``F.linear`` gets to the copy bandwidth per product,
and whether a setting (cuBLASLt instead of cuBLAS, a larger cuBLASLt workspace for split-K
algorithms) moves it. Settings are the process's: run the script once per setting (env vars
``CUBLASLT_WORKSPACE_SIZE`` in KiB, ``CUBLAS_WORKSPACE_CONFIG``; ``--blas cublaslt`` calls
``torch.backends.cuda.preferred_blas_library``).

Usage: python3 small_m_products.py [--model CONFIG.json] [--ms 1,4,16,64,256] [--blas B]
       [--label L]
Each product kind runs over the model's layers with their own weights (nothing L2-resident),
one CUDA graph per (kind, M), best of 5 replays. Prints one table: label, M, then per kind us
per product and TB/s on its weight bytes, and the sum over a step (the layers' four products +
the LM head).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvfit.bench.configs import config_path
import torch.nn.functional as F

from gemv_bench import timed  # benchmarks/kernels/, the script's own folder

MODEL = config_path("qwen3-1.7b")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL)
    p.add_argument("--ms", default="1,4,16,64,256")
    p.add_argument("--blas", default=None, help="cublas or cublaslt (default: torch's choice)")
    p.add_argument("--label", default="default")
    args = p.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    cfg = json.load(open(args.model))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n_layers = cfg["num_hidden_layers"]
    dt = torch.bfloat16
    kinds = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    torch.manual_seed(0)
    ws = {k: [torch.randn(n, kk, device="cuda", dtype=dt) / kk ** 0.5 for _ in range(n_layers)]
          for k, (n, kk) in kinds.items()}
    lm = torch.randn(cfg["vocab_size"], h, device="cuda", dtype=dt)
    print(f"{os.path.basename(args.model)}, {torch.cuda.get_device_name()}, setting "
          f"{args.label}: blas {torch.backends.cuda.preferred_blas_library()}, "
          f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE', '-')}, "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '-')}")
    print("| setting | M | " + " | ".join(f"{k} us (TB/s)" for k in kinds)
          + " | LM head us (TB/s) | step us |")
    print("|---|---:|" + "---:|" * (len(kinds) + 2))
    with torch.inference_mode():
        for m in [int(v) for v in args.ms.split(",")]:
            cells, step = [], 0.0
            for k, (n, kk) in kinds.items():
                x = torch.randn(m, kk, device="cuda", dtype=dt)
                t = timed(lambda _c, x=x, k=k: [F.linear(x, w) for w in ws[k]], 1, 2)
                t /= n_layers
                step += t * n_layers
                cells.append(f"{t * 1e6:.2f} ({n * kk * 2 / t / 1e12:.2f})")
            x = torch.randn(m, h, device="cuda", dtype=dt)
            t = timed(lambda _c: F.linear(x, lm), 1, 3)
            step += t
            cells.append(f"{t * 1e6:.1f} ({lm.numel() * 2 / t / 1e12:.2f})")
            print(f"| {args.label} | {m} | " + " | ".join(cells) + f" | {step * 1e6:,.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
