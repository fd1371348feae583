"""8-bit decode variants against the engine's fp8 default, per head size: CUDA-graph replays of
one call per rotating cache copy (no host launch time; inputs never L2-resident), as
``int8_decode.py`` times them, for a list of launch variants given on the command line. Each
variant's output is compared with the first variant's of its point and KV dtype (column "err":
relative Frobenius error; the first variant is the already-tested default).

A variant is ``layout:BxL:kv_dtype:page:V layout[:key=value...]``, e.g.
``qwen3-1.7b:32x16384:int8:32:HDN:i8_cvt=imma:maxnreg=168:ctas_per_sm=3``; keys are
``choose_config`` arguments (block_n, num_warps, num_stages, maxnreg, ctas_per_sm: the split
count follows them) or ``DecodeConfig`` fields (i8_cvt, num_splits). The first variant of each
point and head size in the list that is fp8_e4m3 is the reference of the "vs fp8" column.

All variants are compiled first by ``--jobs`` worker processes in parallel (each launches its
variants once on a one-request problem of the same shapes: Triton's on-disk cache then serves
the timing process), so compile time costs ~1/jobs of a serial run.

Usage: python3 benchmarks/kernels/decode_sweep.py [--jobs N] VARIANT...  (prints one table,
writes $OUT_DIR/decode_sweep.json). ``--smoke`` (CPU, TRITON_INTERPRET=1, small contexts)
runs each variant once through the same code without timing it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

from kvfit.bench.kernels_common import LAYOUTS, KVSet, scale_kwargs
from kvfit.kernels.decode import DecodeConfig, choose_config, paged_decode

from graph_timing import graph_us  # benchmarks/kernels/, the script's own folder

LAYOUTS = {**LAYOUTS, "d256": (8, 4, 256)}
CHOOSE_KEYS = ("block_n", "num_warps", "num_stages", "maxnreg", "ctas_per_sm", "use_dot",
               "heads", "gluon")  # gluon=1: the Gluon 8-bit kernel (kernels/decode_8bit_gluon.py)
BENCH_KEYS = ("scales",)  # how the int8 scales are stored (_int8_caches), not a launch choice


def parse(spec: str) -> dict:
    parts = spec.split(":")
    layout, bl, kvd, page, vl = parts[:5]
    b, ctx = (int(x) for x in bl.split("x"))
    extra = {}
    for kv in parts[5:]:
        k, v = kv.split("=")
        extra[k] = v if not v.lstrip("-").isdigit() else int(v)
    return dict(spec=spec, layout=layout, batch=b, ctx=ctx, kv_dtype=kvd, page=int(page),
                v_layout=vl, extra=extra)


def config(v: dict) -> DecodeConfig:
    hq, hkv, d = LAYOUTS[v["layout"]]
    dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
          "bfloat16": torch.bfloat16}[v["kv_dtype"]]
    ck = {k: x for k, x in v["extra"].items() if k in CHOOSE_KEYS}
    cfg = choose_config(v["batch"], hkv, hq // hkv, d, v["ctx"], dt, torch.bfloat16,
                        v_t=v["v_layout"] == "HDN", page_size=v["page"], **ck)
    rest = {k: x for k, x in v["extra"].items() if k not in CHOOSE_KEYS + BENCH_KEYS}
    return dataclasses.replace(cfg, **rest)


def _int8_caches(kv: KVSet, vcs: list, how: str) -> list:
    """Per copy (k cache, v cache, scale kwargs) with the int8 scales stored ``how``: "sep" (the
    pool's layout: scale caches of their own), "inline" (each page-head's 64 bytes of scales
    right after its codes in one buffer: strided views of it) or "l2" (every page reads page
    0's scales: they stay in L2, so the time without the scales' DRAM reads; outputs differ)."""
    out = []
    for i, (k, _v) in enumerate(kv.caches):
        v = vcs[i]
        if how == "sep" or kv.scales is None:
            out.append((k, v, scale_kwargs(kv, i)))
        elif how == "l2":
            ks, vs = kv.scales[i]
            out.append((k, v, {"k_scale_cache": ks[:1].expand_as(ks),
                               "v_scale_cache": vs[:1].expand_as(vs)}))
        elif how == "inline":
            pages, h = k.shape[:2]
            p, d = kv.page_size, kv.head_dim
            views = []
            for codes, sc in ((k, kv.scales[i][0]), (v, kv.scales[i][1])):
                buf = torch.empty((pages, h, p * d + 2 * p), dtype=torch.uint8, device=k.device)
                buf[..., :p * d] = codes.reshape(pages, h, p * d).view(torch.uint8)
                buf[..., p * d:] = sc.view(torch.uint8).reshape(pages, h, 2 * p)
                views.append((buf[..., :p * d].view(torch.int8).unflatten(-1, codes.shape[2:]),
                              buf[..., p * d:].view(torch.float16)))
            out.append((views[0][0], views[1][0], {"k_scale_cache": views[0][1],
                                                   "v_scale_cache": views[1][1]}))
        else:
            raise ValueError(f"scales={how!r}: one of sep, inline, l2")
    return out


def _v_caches(kv: KVSet, v_layout: str) -> list:
    if v_layout == "HND":
        return [c[1] for c in kv.caches]
    return [c[1].transpose(2, 3).contiguous() for c in kv.caches]


DEVICE = "cuda"


def compile_only(specs: list[str]) -> None:
    """Launch each variant once on a one-request problem of the same shapes and strides."""
    for spec in specs:
        v = parse(spec)
        hq, hkv, d = LAYOUTS[v["layout"]]
        cfg = config(v)
        kv = KVSet(hkv, d, v["kv_dtype"], 1, v["ctx"], v["page"], DEVICE)
        vc = _v_caches(kv, v["v_layout"])[0]
        q = torch.randn(1, hq, d, device=DEVICE, dtype=torch.bfloat16)
        paged_decode(q, kv.caches[0][0], vc, kv.block_table, kv.kv_lens, torch.empty_like(q),
                     d ** -0.5, cfg, **scale_kwargs(kv, 0))
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def precompile(specs: list[str], jobs: int) -> None:
    if jobs <= 1:
        compile_only(specs)
        return
    shards = [specs[i::jobs] for i in range(jobs)]
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", *s])
             for s in shards if s]
    for p in procs:
        if p.wait() != 0:
            print(f"compile worker exited {p.returncode}", flush=True)


def _smoke_us(fns) -> float:
    t = time.perf_counter()
    fns[0]()
    return (time.perf_counter() - t) * 1e6


def main(argv: list[str]) -> None:
    global DEVICE
    timer = graph_us
    if argv and argv[0] == "--smoke":
        DEVICE, timer, argv = "cpu", _smoke_us, ["--jobs", "1", *argv[1:]]
    if argv and argv[0] == "--compile-only":
        compile_only(argv[1:])
        return
    jobs = 8
    if argv and argv[0] == "--jobs":
        jobs, argv = int(argv[1]), argv[2:]
    variants = [parse(s) for s in argv]
    t0 = time.time()
    precompile(argv, jobs)
    print(f"precompiled {len(argv)} variants in {time.time() - t0:.1f} s", flush=True)
    groups: dict = {}
    for v in variants:
        key = (v["layout"], v["batch"], v["ctx"], v["kv_dtype"], v["page"])
        groups.setdefault(key, []).append(v)
    ref: dict = {}
    res = []
    print(f"{'variant':72} {'splits':>6} {'us':>8} {'TB/s':>6} {'vs fp8':>7} {'err':>8}",
          flush=True)
    for (layout, b, ctx, kvd, page), vs in groups.items():
        hq, hkv, d = LAYOUTS[layout]
        kv = KVSet(hkv, d, kvd, b, ctx, page, DEVICE)
        qs = [torch.randn(b, hq, d, device=DEVICE, dtype=torch.bfloat16) for _ in kv.caches]
        outs = [torch.empty_like(x) for x in qs]
        vcs = {}
        first = None
        for v in vs:
            cfg = config(v)
            if v["v_layout"] not in vcs:
                vcs[v["v_layout"]] = _v_caches(kv, v["v_layout"])
            cs = _int8_caches(kv, vcs[v["v_layout"]], v["extra"].get("scales", "sep"))
            fns = [lambda i=i: paged_decode(qs[i], cs[i][0], cs[i][1], kv.block_table,
                                            kv.kv_lens, outs[i], d ** -0.5, cfg, **cs[i][2])
                   for i in range(kv.reps)]
            us = timer(fns)
            o = outs[0].float()
            first = o.clone() if first is None else first
            err = ((o - first).norm() / first.norm()).item()
            pkey = (layout, b, ctx)
            if kvd == "fp8_e4m3" and pkey not in ref:
                ref[pkey] = us
            rec = dict(v, cfg=str(cfg), bytes=kv.bytes, us=us, tbps=kv.bytes / us / 1e6, err=err,
                       time_vs_fp8=us / ref[pkey] if pkey in ref else None)
            res.append(rec)
            vs_fp8 = f"{rec['time_vs_fp8']:7.3f}" if rec["time_vs_fp8"] else "      -"
            print(f"{v['spec']:72} {cfg.num_splits:6} {us:8.1f} {rec['tbps']:6.2f} {vs_fp8} "
                  f"{err:8.1e}", flush=True)
            _write(res)  # after every variant: a killed run keeps what it measured
        del kv, qs, outs, vcs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    _write(res)


def _write(res: list) -> None:
    out = os.environ.get("OUT_DIR", os.environ.get("OUT", "/tmp"))
    with open(os.path.join(out, "decode_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
