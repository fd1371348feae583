"""Extend attention time with and without key splits (kernels/prefill_split.py): one request's
``q_len`` new tokens over a cached context, Qwen3-1.7B's heads (16 q, 8 KV, 128-d), fp8 pages
(token-minor V, pages of 32) and bf16 pages (HND, pages of 16), timed as CUDA-graph replays (no
launch overhead; the split's merge launch included), medians of 5.

    PYTHONPATH=src python3 benchmarks/kernels/extend_split_bench.py [--out x.json]

Prints one table, a row per variant as it is measured: microseconds per layer for the plain
kernel and for split variants (programs per block, tiles per split at least, rows per block;
the engine's are ``prefill_split.NUM_SPLITS``/``MIN_TILES`` and ``prefill_config``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_us  # noqa: E402

from kvfit.attention.meta_builder import build_metadata  # noqa: E402
from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config  # noqa
from kvfit.kernels.prefill_split import ExtendSplit  # noqa: E402
from kvfit.kvcache.dtypes import kv_format  # noqa: E402
from kvfit.kvcache.pool import MHAKVCache  # noqa: E402
from kvfit.kvcache.spec import KVLayerSpec  # noqa: E402

# variant labels: "plain" (no split) or space-separated fields s<splits> t<min tiles> and,
# overriding the engine's ``prefill_config``, m<rows> n<keys per tile> w<warps> st<stages>
VARIANTS = ["plain", "s8 t8", "s8 t16", "s16 t4", "s8 t8 m32", "s16 t4 m32"]
_FIELDS = {"m": "block_m", "n": "block_n", "w": "num_warps", "st": "num_stages"}


def parse_variant(label: str, base):
    """(num_splits, min_tiles, PrefillConfig) of a variant label; splits None = plain."""
    import dataclasses
    import re

    if label == "plain":
        return None, None, base
    splits, tiles, over = 8, 8, {}
    for tok in label.split():
        key, val = re.fullmatch(r"([a-z]+)(\d+)", tok).groups()
        if key == "s":
            splits = int(val)
        elif key == "t":
            tiles = int(val)
        else:
            over[_FIELDS[key]] = int(val)
    return splits, tiles, dataclasses.replace(base, **over)


def point(kv_dtype, ps, v_layout, q_len, ctx, variants=VARIANTS):
    """Yields (label, us per layer) for each variant at one point."""
    hq, hkv, d = 16, 8, 128
    pages = -(-ctx // ps)
    pool = MHAKVCache([KVLayerSpec("full", hkv, d)], pages + 1, ps, kv_format(kv_dtype), "cuda",
                      v_layout=v_layout)
    pool.store_kv(0, torch.randn(ctx, hkv, d, device="cuda"), torch.randn(ctx, hkv, d,
                                                                          device="cuda"),
                  torch.arange(ctx, device="cuda"))
    table = [list(range(pages))]
    meta = build_metadata([q_len], [ctx], table, ps, "cuda")
    q = torch.randn(q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    base = prefill_config(d, q.dtype, pool.dtype)
    for label in variants:
        ns, mt, cfg = parse_variant(label, base)
        split = None
        if ns is not None:
            split = ExtendSplit()
            split.num_splits, split.min_tiles = ns, mt
            split.reserve(q_len, hq, d, "cuda")
        blocks = order_prefill_blocks([q_len], hq // hkv, cfg.block_m, "cuda", [ctx])

        def f(split=split, cfg=cfg, blocks=blocks):
            paged_prefill(q, pool.k_caches[0], pool.v_caches[0], meta.block_table,
                          meta.cu_seqlens_q, meta.kv_lens, blocks, cfg, out, d ** -0.5,
                          v_t=v_layout == "HDN", split=split)

        yield label, graph_us([f])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--q-lens", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--ctxs", type=int, nargs="+", default=[1024, 4224, 16384])
    p.add_argument("--variants", nargs="+", default=VARIANTS,
                   help='e.g. "plain" "s8 t8" "s8 t8 m128 w8" "s4 t8 n128 st3"')
    p.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3", "bfloat16"])
    args = p.parse_args()
    rows = []
    print("| KV | q_len | context | variant (splits, min tiles, rows) | us per layer |")
    print("|---|---:|---:|---|---:|", flush=True)
    layouts = {"fp8_e4m3": (32, "HDN"), "bfloat16": (16, "HND")}
    for kv_dtype in args.kv_dtypes:
        ps, lay = layouts[kv_dtype]
        for q_len in args.q_lens:
            for ctx in args.ctxs:
                for label, us in point(kv_dtype, ps, lay, q_len, ctx, args.variants):
                    rows.append({"kv_dtype": kv_dtype, "q_len": q_len, "ctx": ctx,
                                 "variant": label, "us": us})
                    print(f"| {kv_dtype} | {q_len} | {ctx} | {label} | {us:.1f} |", flush=True)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
