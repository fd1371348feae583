"""The products of a small decode step at M token rows: the GEMV path (``kernels/gemv.py``, what
``models/decode_rows.py`` runs up to ``GEMV_MAX_ROWS`` rows) against the batched path (cuBLAS
products, the norm kernels and the activation kernel), over a whole model's layers.

One "step" = for each of the model's layers (each with its own weights, so nothing stays in L2):
    GEMV path:    gemv(qkv, norm + residual) ; gemv(o) ; gemv(gate_up, norm + residual, act) ;
                  gemv(down)
    batched path: add + RMSNorm ; F.linear(qkv) ; F.linear(o) ; add + RMSNorm ;
                  F.linear(gate_up) ; act_and_mul ; F.linear(down)
then the LM head (float32 logits: gemv's float32 output, or F.linear + .float()). Attention is
left out: it is the same on both paths. Timed as one CUDA graph per (path, M), CUDA events,
best of 5 replays; the bytes are the weights read once per step. Decides GEMV_MAX_ROWS: the
largest M where the GEMV path is not slower than the batched path.

Usage: python3 gemv_rows_bench.py [--model CONFIG.json] [--ms 1,2,3,4,6,8,12,16]
       [--block-ms 4] [--tiles SWEEP.json] [--pdl] [--json F]
Prints one table: M, batched-path us and TB/s, then per rows-per-program (block_m) the GEMV
path's us and its ratio to the batched path. ``--tiles``: the best tiles of
``gemv_rows_sweep.py --json`` (else the module's table and rule). ``--pdl``: one more column,
the GEMV path at the first block_m with programmatic dependent launch on (``kernels/pdl.py``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from kvfit.kernels.fused_act import act_and_mul
from kvfit.kernels.fused_norm import fused_add_rms_norm, rms_norm
from kvfit.kernels import gemv as gemv_mod
from kvfit.kernels.gemv import gemv

from gemv_bench import timed  # benchmarks/kernels/, the script's own folder

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "..", "src", "kvfit", "bench", "configs", "qwen3-1.7b.json")


def layer_weights(cfg: dict, n_layers: int, dtype) -> list[dict]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = []
    for _ in range(n_layers):  # [N, K] row-major, as nn.Linear stores them; scaled like init
        out.append({"qkv": torch.randn(q + 2 * kv, h, device="cuda", dtype=dtype) / h ** 0.5,
                    "o": torch.randn(h, q, device="cuda", dtype=dtype) / q ** 0.5,
                    "gate_up": torch.randn(2 * inter, h, device="cuda", dtype=dtype) / h ** 0.5,
                    "down": torch.randn(h, inter, device="cuda", dtype=dtype) / inter ** 0.5,
                    "n_in": 1 + 0.1 * torch.randn(h, device="cuda", dtype=dtype),
                    "n_post": 1 + 0.1 * torch.randn(h, device="cuda", dtype=dtype)})
    return out


def step_gemv(x, layers, lm_head, q_size):
    residual = None
    for w in layers:
        qkv, residual = gemv(x, w["qkv"], norm=(w["n_in"], 1e-6, 0.0), residual=residual)
        h = gemv(qkv[:, :q_size].contiguous(), w["o"])  # stands in for attention's output
        a, residual = gemv(h, w["gate_up"], norm=(w["n_post"], 1e-6, 0.0), residual=residual,
                           gated_act="silu")
        x = gemv(a, w["down"])
    return gemv(x, lm_head, out_dtype=torch.float32)


def step_batched(x, layers, lm_head, q_size):
    residual = x
    for i, w in enumerate(layers):
        h, residual = fused_add_rms_norm(x, residual, w["n_in"], 1e-6) if i else (
            rms_norm(x, w["n_in"], 1e-6), residual)
        qkv = F.linear(h, w["qkv"])
        h = F.linear(qkv[:, :q_size].contiguous(), w["o"])
        h, residual = fused_add_rms_norm(h, residual, w["n_post"], 1e-6)
        x = F.linear(act_and_mul(F.linear(h, w["gate_up"]), "silu"), w["down"])
    return F.linear(x, lm_head).float()


def graph_time(fn, reps: int = 3) -> float:
    """Seconds per call of fn() from a CUDA graph of ``reps`` calls, best of 5 replays."""
    return timed(lambda _copy: fn(), 1, reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL)
    p.add_argument("--ms", default="1,2,3,4,6,8,12,16")
    p.add_argument("--layers", type=int, default=None, help="default: the config's")
    p.add_argument("--block-ms", default=str(gemv_mod.BLOCK_M))
    p.add_argument("--tiles", default=None)
    p.add_argument("--pdl", action="store_true", help="also time the GEMV path with PDL on")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = json.load(open(args.model))
    dtype = torch.bfloat16
    n_layers = args.layers or cfg["num_hidden_layers"]
    torch.manual_seed(0)
    layers = layer_weights(cfg, n_layers, dtype)
    lm_head = torch.randn(cfg["vocab_size"], cfg["hidden_size"], device="cuda", dtype=dtype)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q_size = cfg["num_attention_heads"] * hd
    nbytes = sum(t.numel() * t.element_size() for w in layers for t in w.values())
    nbytes += lm_head.numel() * lm_head.element_size()
    if args.tiles:
        for per_bm in json.load(open(args.tiles)).values():
            for bm, e in per_bm.items():
                gemv_mod.GEMV_CONFIG[(e["n_out"], e["k"], e["gated"], int(bm))] = tuple(e["tile"])
    bms = [int(v) for v in args.block_ms.split(",")]
    from kvfit.kernels import pdl
    rows = []
    print(f"{os.path.basename(args.model)}: {n_layers} layers + LM head, "
          f"{nbytes / 1e9:.2f} GB of weights per step; {torch.cuda.get_device_name()}")
    print("| M | batched path us (TB/s) | " + " | ".join(
        [f"GEMV block_m={bm} us (/ batched)" for bm in bms]
        + ["GEMV with PDL us (/ batched)"] * args.pdl) + " |")
    print("|---:|---:|" + "---:|" * (len(bms) + args.pdl))
    with torch.inference_mode():
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, cfg["hidden_size"], device="cuda", dtype=dtype)
            tb = graph_time(lambda: step_batched(x, layers, lm_head, q_size))
            row = {"m": m, "batched_us": tb * 1e6}
            cells = []
            for bm in bms:
                gemv_mod.BLOCK_M = bm
                tg = graph_time(lambda: step_gemv(x, layers, lm_head, q_size))
                row[f"gemv_bm{bm}_us"] = tg * 1e6
                cells.append(f"{tg * 1e6:,.1f} ({tg / tb:.3f})")
            gemv_mod.BLOCK_M = bms[0]
            if args.pdl:
                pdl.ENABLED = True
                tg = graph_time(lambda: step_gemv(x, layers, lm_head, q_size))
                pdl.ENABLED = False
                row["gemv_pdl_us"] = tg * 1e6
                cells.append(f"{tg * 1e6:,.1f} ({tg / tb:.3f})")
            rows.append(row)
            print(f"| {m} | {tb * 1e6:,.1f} ({nbytes / tb / 1e12:.2f}) | " + " | ".join(cells)
                  + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
