"""Where an int8 prefill step's attention time goes against fp8's, per layer: the RoPE kernel,
the K transform (centering + Hadamard rotation: ``KVTransform.transform_qk`` in torch, or the
fused path when the backend has one), the page-chunk store and the prefill kernel, at one
prompt of Qwen3-1.7B heads (16/8 x 128, token-minor V pages of 32, the engine's defaults).

Each part is timed two ways: eager (events around 20 back-to-back launches: what a prefill
step pays when the host is the bottleneck) and as CUDA-graph replays (GPU time only).
Usage: python3 benchmarks/kernels/prefill_parts.py [prompt_len]; prints one table, writes
$OUT_DIR/prefill_parts.json. ``--smoke`` (CPU, TRITON_INTERPRET=1) runs each part once.
``--v-layouts [prompt_len]``: only the 64-d prefill kernel with HND against token-minor V.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from kvfit.kernels.fused_rope import apply_rope
from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
from kvfit.kernels.store import split_store_chunks, store_kv_chunks
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.kv_transform import KVTransform

from graph_timing import graph_us  # benchmarks/kernels/, the script's own folder

HQ, HKV, D, PAGE = 16, 8, 128, 32
DEVICE = "cuda"


def eager_us(fn, iters: int = 20) -> float:
    fn()
    if DEVICE != "cuda":
        return 0.0
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(times)[1]


def parts(kvd: str, n: int) -> dict:
    dev = DEVICE
    fmt = kv_format(kvd)
    dt = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[kvd]
    pages = -(-n // PAGE)
    kc = torch.zeros(pages + 1, HKV, PAGE, D, dtype=dt, device=dev)
    vc = torch.zeros(pages + 1, HKV, D, PAGE, dtype=dt, device=dev)
    sc = {}
    if dt == torch.int8:
        sc = dict(k_scale_cache=torch.zeros(pages + 1, HKV, PAGE, dtype=torch.float16, device=dev),
                  v_scale_cache=torch.zeros(pages + 1, HKV, PAGE, dtype=torch.float16, device=dev))
    table = (torch.arange(pages, dtype=torch.int32, device=dev) + 1)[None, :]
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(n, D, device=dev)
    sin = torch.randn(n, D, device=dev)
    pos = torch.arange(n, device=dev)
    chunks = split_store_chunks([n], [n], PAGE, dev)
    cfg = prefill_config(D, torch.float16, dt)
    blocks = order_prefill_blocks([n], HQ // HKV, cfg.block_m, dev)
    out = torch.empty_like(q)
    tr = KVTransform([torch.randn(HKV, D) for _ in range(1)], rotate=True, device=dev) \
        if dt == torch.int8 else None
    fns = {"rope": lambda: apply_rope(q, k, cos, sin, pos)}
    if tr is not None:
        fns["transform_qk (torch)"] = lambda: tr.transform_qk(0, q, k)
    fns["store_kv_chunks"] = lambda: store_kv_chunks(k, v, kc, vc, chunks, cu, lens, table, fmt,
                                                     **sc)
    fns["paged_prefill"] = lambda: paged_prefill(q, kc, vc, table, cu, lens, blocks, cfg, out,
                                                 D ** -0.5, v_t=True, **sc)
    if tr is not None:  # Triton's int8 -> f16 cast (I2F) instead of the inline asm
        cast = dataclasses.replace(cfg, i8_cvt="cast")
        fns["paged_prefill i8 cast"] = lambda: paged_prefill(q, kc, vc, table, cu, lens, blocks,
                                                             cast, out, D ** -0.5, v_t=True,
                                                             **sc)
    if tr is not None:  # the fused rotation: k in the chunk store, q in the prefill kernel
        mu = tr.k_mean[0]
        fns["store_kv_chunks rotate"] = lambda: store_kv_chunks(
            k, v, kc, vc, chunks, cu, lens, table, fmt, k_mean=mu, rotate=True, **sc)
        fns["paged_prefill rotate_q"] = lambda: paged_prefill(
            q, kc, vc, table, cu, lens, blocks, cfg, out, D ** -0.5, v_t=True, rotate_q=True,
            **sc)
    rec = {}
    if tr is not None:  # the fused rotation and the asm conversion against the unfused path
        qt, kt = tr.transform_qk(0, q, k)
        store_kv_chunks(kt, v, kc, vc, chunks, cu, lens, table, fmt, **sc)
        ref = paged_prefill(qt.to(q.dtype), kc, vc, table, cu, lens, blocks,
                            dataclasses.replace(cfg, i8_cvt="cast"), out.clone(), D ** -0.5,
                            v_t=True, **sc).float()
        fns["store_kv_chunks rotate"]()
        fused = paged_prefill(q, kc, vc, table, cu, lens, blocks, cfg, out.clone(), D ** -0.5,
                              v_t=True, rotate_q=True, **sc).float()
        rec["fused_vs_unfused_rel_err"] = ((fused - ref).norm() / ref.norm()).item()
        print(f"int8 prefill, fused rotation + asm vs transform_qk + cast: relative error "
              f"{rec['fused_vs_unfused_rel_err']:.2e}", flush=True)
    for name, fn in fns.items():
        rec[name] = dict(eager_us=eager_us(fn),
                         graph_us=graph_us([fn]) if dev == "cuda" else 0.0)
    return rec


def prefill_by_v_layout(n: int) -> list:
    """Prefill kernel time of one ``n``-token prompt at SmolLM2 heads (9/3 x 64, pages of
    16) with HND and token-minor V pages, fp8 and int8 (graph replays): the V layout choice of
    64-d 8-bit pools (TritonBackend.v_layout) seen from the prefill side."""
    dev, hq, hkv, d, page = DEVICE, 9, 3, 64, 16
    pages = -(-n // page)
    table = (torch.arange(pages, dtype=torch.int32, device=dev) + 1)[None, :]
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows = []
    for kvd, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("int8", torch.int8)):
        cfg = prefill_config(d, torch.float16, dt)
        blocks = order_prefill_blocks([n], hq // hkv, cfg.block_m, dev)
        for vl in ("HND", "HDN"):
            kc = torch.randn(pages + 1, hkv, page, d, device=dev).mul_(20).to(dt)
            vc = torch.randn(pages + 1, hkv, page, d, device=dev).mul_(20).to(dt)
            if vl == "HDN":
                vc = vc.transpose(2, 3).contiguous()
            sc = {}
            if dt == torch.int8:
                sc = {f"{x}_scale_cache": torch.rand(pages + 1, hkv, page, device=dev).add_(
                    0.5).mul_(0.02).half() for x in "kv"}
            fn = (lambda kc=kc, vc=vc, sc=sc, cfg=cfg, blocks=blocks, vl=vl: paged_prefill(
                q, kc, vc, table, cu, lens, blocks, cfg, out, d ** -0.5, v_t=vl == "HDN", **sc))
            us = graph_us([fn]) if dev == "cuda" else (fn() is None) * 0.0
            rows.append(dict(kv_dtype=kvd, v_layout=vl, prompt=n, graph_us=us))
            print(f"prefill {n} SmolLM2 heads {kvd:>8} V {vl}: {us:8.1f} us", flush=True)
    return rows


def main():
    global DEVICE
    args = sys.argv[1:]
    if args and args[0] == "--smoke":
        DEVICE, args = "cpu", args[1:] or ["64"]
    if args and args[0] == "--v-layouts":  # the 64-d prefill by V layout only
        rows = prefill_by_v_layout(int(args[1]) if len(args) > 1 else 2048)
        out = os.environ.get("OUT_DIR", os.environ.get("OUT", "/tmp"))
        with open(os.path.join(out, "prefill_v_layouts.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    n = int(args[0]) if args else 1024
    res = {kvd: parts(kvd, n) for kvd in ("fp8_e4m3", "int8")}
    print(f"prefill parts per layer, {n}-token prompt, heads {HQ}/{HKV} x {D}, pages {PAGE}")
    print(f"{'part':24} {'fp8 eager':>10} {'fp8 graph':>10} {'int8 eager':>11} {'int8 graph':>11}")
    for name in res["int8"]:
        if name.endswith("_err"):
            continue
        f = res["fp8_e4m3"].get(name)
        i = res["int8"][name]
        fe = f"{f['eager_us']:10.1f} {f['graph_us']:10.1f}" if f else f"{'-':>10} {'-':>10}"
        print(f"{name:24} {fe} {i['eager_us']:11.1f} {i['graph_us']:11.1f}")
    out = os.environ.get("OUT_DIR", os.environ.get("OUT", "/tmp"))
    with open(os.path.join(out, "prefill_parts.json"), "w") as f:
        json.dump(dict(prompt=n, parts=res), f, indent=1)


if __name__ == "__main__":
    main()
