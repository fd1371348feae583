"""Where the int8 KV transform (k - mu, then q and k @ H) should run, per layer of one step:

- fused: ``apply_rope(kv_store=...)`` with a rotating target, one launch (RoPE, q @ H, the
  butterflies of (k - mu) @ H in registers, int8 quantize and store of K and V);
- unfused: ``apply_rope`` (no store), the torch transform (k - mu, two matmuls by H, the casts;
  what ``KVTransform.transform_qk`` does), then ``store_kv``.

Timed as CUDA-graph replays of 28 layers' calls (Qwen3-1.7B heads 16/8 x 128, int8, pages of
32, token-minor V) at 1 and 64 tokens per step. Usage: python3 benchmarks/kernels/rotation_store.py;
writes $OUT_DIR/rotation_store.json and prints one table.
"""

from __future__ import annotations

import json
import math
import os

import torch

from kvfit.attention.base import KVStoreTarget
from kvfit.kernels.fused_rope import apply_rope
from kvfit.kernels.store import store_kv

from graph_timing import graph_us  # benchmarks/kernels/, the script's own folder

LAYERS = 28


def main():
    from kvfit.kvcache.dtypes import KVFormat, kv_format

    try:
        fmt = kv_format("int8")
    except ValueError:
        fmt = KVFormat("int8", torch.int8, True, 127.0)
    dev = torch.device("cuda")
    hq, hk, d, ps, num_pages = 16, 8, 128, 32, 512
    h = torch.ones(1, 1, device=dev)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = (h / math.sqrt(d)).contiguous()
    emb = torch.outer(torch.arange(8192, device=dev).float(),
                      1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d)))
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos(), emb.sin()
    res = []
    print(f"{'tokens':>6} {'fused us/layer':>15} {'unfused us/layer':>17} {'unfused/fused':>14}")
    for t in (1, 64):
        layers = []
        for _ in range(LAYERS):
            kc = torch.zeros(num_pages, hk, ps, d, dtype=torch.int8, device=dev)
            vc = torch.zeros(num_pages, hk, d, ps, dtype=torch.int8, device=dev)
            ks = torch.zeros(num_pages, hk, ps, dtype=torch.float16, device=dev)
            vs = torch.zeros_like(ks)
            mu = torch.randn(hk, d, device=dev)
            qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
            q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], -1))
            slots = torch.randperm(num_pages * ps, device=dev)[:t]
            pos = torch.randint(0, 8192, (t,), device=dev)
            layers.append((kc, vc, ks, vs, mu, q, k, v, slots, pos))

        def fused():
            for kc, vc, ks, vs, mu, q, k, v, slots, pos in layers:
                target = KVStoreTarget(kc, vc, slots, fmt, 1.0, 1.0, "HDN", k_scale_cache=ks,
                                       v_scale_cache=vs, k_mean=mu, rotate=True)
                apply_rope(q, k, cos, sin, pos, kv_store=(v, target))

        def unfused():
            for kc, vc, ks, vs, mu, q, k, v, slots, pos in layers:
                rq, rk = apply_rope(q, k, cos, sin, pos)
                rq = (rq.float() @ h).to(rq.dtype)  # q @ H
                kt = (rk.float() - mu) @ h  # (k - mu) @ H
                store_kv(kt, v, kc, vc, slots, fmt, v_layout="HDN", k_scale_cache=ks,
                         v_scale_cache=vs)

        f_us, u_us = graph_us([fused], 20) / LAYERS, graph_us([unfused], 20) / LAYERS
        res.append(dict(tokens=t, fused_us_per_layer=f_us, unfused_us_per_layer=u_us))
        print(f"{t:>6} {f_us:15.2f} {u_us:17.2f} {u_us / f_us:14.2f}", flush=True)
    out = os.environ.get("OUT_DIR", "/tmp")
    with open(os.path.join(out, "rotation_store.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
