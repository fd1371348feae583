"""The batch-1 megakernel question, measured: a model's per-layer products (qkv, o, gate/up,
down; plain GEMVs, no norms) as separate GEMV kernels in a CUDA graph, against one persistent
launch that walks them with grid-wide counts (``gemv_chain_kernel.py`` beside this script), per
layer and for the whole model in one launch, with and without an L2 prefetch of the next
product's rows.

Usage: python3 gemv_chain_bench.py [--model CONFIG.json] [--layers L] [--variants V,...]
Variant: ``SCOPE:programs_per_sm:stages:[e]prefetch_blocks:warps[:tiles]``; SCOPE ``model``
(one launch of all layers) or ``layer`` (one launch per layer); ``e``: the next product's
blocks asked of L2 at the start of the current one, else just before its wait; tiles one of
``TILES`` (BN x BK per product, default ``a``). Prints one table: us per step (the layers'
products), TB/s on the weight bytes, ratio to the separate kernels; checks every variant's
output against the separate kernels' and that no wait timed out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvfit.bench.configs import config_path

from kvfit.kernels.gemv import gemv

from gemv_bench import timed  # benchmarks/kernels/, the script's own folder
from gemv_chain_kernel import resident_programs, run_chain

MODEL = config_path("qwen3-1.7b")
TILES = {"a": [(8, 512), (8, 256), (8, 512), (4, 512)],
         "b": [(16, 256), (16, 256), (16, 256), (4, 512)],
         "c": [(4, 512), (4, 512), (4, 512), (2, 1024)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--variants", default="model:2:3:0:4,model:2:3:1:4,layer:2:3:1:4")
    args = p.parse_args()
    cfg = json.load(open(args.model))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n_layers = args.layers or cfg["num_hidden_layers"]
    dt = torch.bfloat16
    torch.manual_seed(0)
    # product j reads slot j's first K_j values: qkv (h) -> o (the first q of qkv's output,
    # standing in for attention's) -> gate/up as one plain product (2 I) -> down (the first I)
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    ws = [torch.randn(n_layers, n, k, device="cuda", dtype=dt) / k ** 0.5 for n, k in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    slot = max(max(s) for s in shapes)
    x0 = torch.randn(h, device="cuda", dtype=dt)

    def separate():
        x = x0
        for layer in range(n_layers):
            y = gemv(x[None, :shapes[0][1]], ws[0][layer])[0]
            y = gemv(y[None, :shapes[1][1]].contiguous(), ws[1][layer])[0]
            y = gemv(y[None, :shapes[2][1]], ws[2][layer])[0]
            x = gemv(y[None, :shapes[3][1]].contiguous(), ws[3][layer])[0]
        return x

    with torch.inference_mode():
        ref = separate().float()
        t_sep = timed(lambda _c: separate(), 1, 3)
        print(f"{os.path.basename(args.model)}: {n_layers} layers, {nbytes / 1e9:.2f} GB of "
              f"weights; {torch.cuda.get_device_name()}")
        print("| variant | programs | regs / smem | us per step | TB/s | / separate | max rel err |"
              " timeouts |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        print(f"| separate GEMV kernels (graph) | | | {t_sep * 1e6:.1f} | "
              f"{nbytes / t_sep / 1e12:.2f} | 1.000 | | |")
        buf = torch.zeros(4, slot, device="cuda", dtype=dt)
        cnt = torch.zeros(4 * n_layers, device="cuda", dtype=torch.int32)
        err = torch.zeros(1, device="cuda", dtype=torch.int32)
        for v in args.variants.split(","):
            parts = v.split(":")
            scope, per_sm, stages, warps = parts[0], *map(int, parts[1:3]), int(parts[4])
            early = parts[3].startswith("e")  # e2: two blocks asked for a product early
            pf = int(parts[3].lstrip("e"))
            tiles = TILES[parts[5] if len(parts) > 5 else "a"]
            kern = run_chain(buf, [w[:1] for w in ws], tiles, cnt, err, programs=1,
                             stages=stages, prefetch_blocks=pf, early=early, num_warps=warps)
            fits = resident_programs(kern, buf.device)
            progs = min(per_sm * torch.cuda.get_device_properties(0).multi_processor_count, fits)

            def chain():
                buf[0, :h].copy_(x0)
                cnt.zero_()
                if scope == "model":
                    run_chain(buf, ws, tiles, cnt, err, programs=progs, stages=stages,
                              prefetch_blocks=pf, early=early, num_warps=warps)
                else:
                    for layer in range(n_layers):  # each launch its own four counts
                        run_chain(buf, [w[layer:layer + 1] for w in ws], tiles,
                                  cnt[4 * layer:4 * layer + 4], err, programs=progs,
                                  stages=stages, prefetch_blocks=pf, early=early,
                                  num_warps=warps)
                return buf[0, :h]

            err.zero_()
            out = chain().float()
            torch.cuda.synchronize()
            rel = ((out - ref).norm() / ref.norm()).item()
            t = timed(lambda _c: chain(), 1, 3)
            print(f"| {v} | {progs} (fit {fits}) | {kern.n_regs} / {kern.metadata.shared} | "
                  f"{t * 1e6:.1f} | {nbytes / t / 1e12:.2f} | {t / t_sep:.3f} | {rel:.1e} | "
                  f"{int(err.item())} |", flush=True)


if __name__ == "__main__":
    main()
