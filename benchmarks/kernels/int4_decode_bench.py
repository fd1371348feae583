"""Decode attention time, int4 pool (kernels/decode_int4.py) against fp8_e4m3 (kernels/decode.py,
the triton backend's layout and launch choice), on the same shapes (batch x context >= 128k
tokens). Prints one table; --json writes the rows.

    python3 benchmarks/kernels/int4_decode_bench.py [--json out.json]

Bytes are what one call must read: fp8 2 x D per token and head; int4 the packed codes, K's
scale/zero per page and V's per token group (5D/4 per token and head) plus the residual page.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = [  # (name, Hq, Hkv, D, batch, context)
    ("qwen3-1.7b-like", 16, 8, 128, 64, 2048),
    ("qwen3-1.7b-like", 16, 8, 128, 16, 8192),
    ("smollm2-like", 9, 3, 64, 64, 2048),
    ("gemma3-like", 4, 1, 256, 128, 1024),
]


def _table(batch, pages_per_req, dev, g):
    n = batch * pages_per_req
    perm = torch.randperm(n, generator=g, device=dev).to(torch.int32)
    return perm.view(batch, pages_per_req).contiguous(), n


def bench_fp8(hq, hkv, d, batch, ctx, dev, g):
    import triton

    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kernels.decode import choose_config, paged_decode

    ps = TritonBackend.default_page_size("fp8_e4m3", d)
    layout = TritonBackend.v_layout("fp8_e4m3", ps, d)
    bt, n = _table(batch, -(-ctx // ps), dev, g)
    k = torch.randn(n, hkv, ps, d, generator=g, device=dev).to(torch.float8_e4m3fn)
    vshape = (n, hkv, ps, d) if layout == "HND" else (n, hkv, d, ps)
    v = torch.randn(vshape, generator=g, device=dev).to(torch.float8_e4m3fn)
    q = torch.randn(batch, hq, d, generator=g, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = choose_config(batch, hkv, hq // hkv, d, ctx, k.dtype, q.dtype, sms,
                        v_t=layout == "HDN")
    fn = lambda: paged_decode(q, k, v, bt, lens, out, d ** -0.5, cfg)  # noqa: E731
    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    return ms, 2 * batch * ctx * hkv * d, ps


def bench_int4(hq, hkv, d, batch, ctx, dev, g):
    import triton

    from kvfit.kernels.decode_int4 import choose_splits, int4_decode
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.int4_pool import Int4KVCache
    from kvfit.kvcache.spec import KVLayerSpec

    full = ctx // 32
    bt, n = _table(batch, -(-ctx // 32), dev, g)
    pool = Int4KVCache([KVLayerSpec("full", hkv, d)], n, 32, kv_format("int4"), dev,
                       num_slots=batch, residual_dtype=torch.bfloat16)
    for t in (pool.k_caches[0], pool.v_caches[0]):
        t.random_(0, 256, generator=g)
    for t in (pool.k_scale_caches[0], pool.v_scale_caches[0]):
        t.copy_(torch.rand(t.shape, generator=g, device=dev) * 0.1 + 0.01)
    for t in (pool.k_zero_caches[0], pool.v_zero_caches[0], pool.k_residual[0],
              pool.v_residual[0]):
        t.copy_(torch.randn(t.shape, generator=g, device=dev))
    q = torch.randn(batch, hq, d, generator=g, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    splits = choose_splits(batch, hkv, ctx, sms)
    fn = lambda: int4_decode(q, pool, 0, bt, lens, slots, out, d ** -0.5,  # noqa: E731
                             num_splits=splits)
    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    tail = ctx - full * 32
    nbytes = batch * hkv * (full * 32 * d * 5 // 4 + 2 * tail * d * 2)
    return ms, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    rows = []
    print(f"GPU: {torch.cuda.get_device_name(dev)}; bf16 queries; median of do_bench")
    print("| shape | Hq/Hkv/D | batch x context | fp8 us | fp8 TB/s | int4 us | int4 TB/s | "
          "int4 speedup |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, hq, hkv, d, b, ctx in SHAPES:
        f_ms, f_bytes, ps = bench_fp8(hq, hkv, d, b, ctx, dev, g)
        i_ms, i_bytes = bench_int4(hq, hkv, d, b, ctx, dev, g)
        row = dict(shape=name, hq=hq, hkv=hkv, d=d, batch=b, context=ctx, fp8_page=ps,
                   fp8_us=f_ms * 1e3, int4_us=i_ms * 1e3, fp8_tbs=f_bytes / f_ms / 1e9,
                   int4_tbs=i_bytes / i_ms / 1e9, speedup=f_ms / i_ms)
        rows.append(row)
        print(f"| {name} | {hq}/{hkv}/{d} | {b} x {ctx} | {row['fp8_us']:.1f} | "
              f"{row['fp8_tbs']:.2f} | {row['int4_us']:.1f} | {row['int4_tbs']:.2f} | "
              f"{row['speedup']:.2f}x |", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
