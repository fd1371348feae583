"""``kvfit bench kernels``: our decode/prefill kernels vs FlashInfer's on identical inputs.

"Ours" is the kernel the triton backend runs: the Triton kernels, or the Gluon 8-bit decode
(``kernels/decode_8bit_gluon.py``) where its ``DEFAULT_ON`` lists the GPU (``ours_cfg`` says
which).

For each head layout x KV dtype x (batch, context) point it fills random HND pages (pages of a
request scattered at random over the pool), rotates among several copies of the cache so the
inputs never sit in L2, and times each kernel with ``triton.testing.do_bench`` (median). It prints
µs, achieved TB/s (KV bytes read / time), % of the copy bandwidth measured in the same run,
KV elements/s, and the fp8/bf16 speedup; it writes ``kernels.json`` and ``kernels.png`` under
``--out``. Prefill points time a whole causal prompt (empty prefix) and report TFLOP/s.
Gemma 3 layouts (``--layouts gemma3-270m,gemma3-4b,gemma3-12b``) have sliding-window layers: each
of their points also times our kernels over the window (``swa_us``) and prints its time against
the full layer's at the same context (``swa/full``: ~1 inside the window, < 1 beyond it).
MLA layouts (``deepseek-v2-lite``, ``deepseek-v2``: a latent cache, bench/kernels_mla.py) time
our MLA kernels and FlashInfer's (the fi backend's MLA path; 16-bit and e4m3 latents), decode
as CUDA-graph replays.
``--tensor-parallel-size N`` times the shapes one rank of an N-GPU group runs (its query heads,
its KV heads: ``parallel/layout.py``; MLA: its query heads over the whole latent).
"""

from __future__ import annotations

from functools import partial

import argparse
import json
import os
import time
from dataclasses import dataclass

from kvfit.bench.kernels_common import (DEFAULT_LAYOUTS, LAYOUTS, WINDOWS, KVSet, _torch_dtype,
                                        NO_FI_INT8, copy_bandwidth, ours_v_caches, ours_v_layout,
                                        page_size, rank_heads, rotating, scale_kwargs,
                                        time_fi_into)
from kvfit.bench.kernels_mla import MLA_LAYOUTS, run_mla_decode
from kvfit.bench.kernels_prefill import run_prefill


@dataclass
class Case:
    layout: str
    kv_dtype: str
    batch: int
    context: int


def parser() -> argparse.ArgumentParser:
    """The ``kvfit bench kernels`` flags; ``--page-size`` is EngineConfig's."""
    import dataclasses

    from kvfit.config import EngineConfig, add_engine_args

    p = argparse.ArgumentParser(prog="kvfit bench kernels", description=__doc__)
    p.add_argument("--out", default="bench-out/kernels")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help=f"of {', '.join(LAYOUTS)}, {', '.join(MLA_LAYOUTS)}")
    p.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3,int8")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096,16384,65536")
    p.add_argument("--max-gib", type=float, default=40.0, help="skip points whose KV is larger")
    p.add_argument("--prefill-contexts", default="1024,4096,16384",
                   help="prompt lengths for prefill points (batch = 16k tokens / length)")
    p.add_argument("--no-fi", action="store_true", help="skip FlashInfer")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    # the engine flags that shape a kernel call: --page-size (default: the engine's choice
    # per KV dtype and head size on the triton backend) and --tensor-parallel-size (one rank's
    # heads)
    add_engine_args(p, skip=tuple(f.name for f in dataclasses.fields(EngineConfig)
                                  if f.name not in ("page_size", "tensor_parallel_size")))
    return p


def tp_refusals(layouts: list[str], tp_size: int) -> list[str]:
    """Layouts whose heads do not split over ``tp_size`` ranks, with the reason."""
    from kvfit.parallel.layout import head_refusals

    out = []
    for layout in layouts:
        hq, hkv = (MLA_LAYOUTS[layout][0], 1) if layout in MLA_LAYOUTS else LAYOUTS[layout][:2]
        out += [f"{layout}: {r}" for r in head_refusals(hq, hkv, tp_size)] if tp_size > 1 else []
    return out


def time_ours_decode(kv: KVSet, hq, d, cfg, window=None) -> float:
    import torch
    import triton

    from kvfit.kernels.decode import paged_decode, split_scratch

    vcs = ours_v_caches(kv) if cfg.v_t else [c[1] for c in kv.caches]
    qs = [torch.randn(kv.batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in kv.caches]
    outs = [torch.empty_like(q) for q in qs]
    # static scratch, as the engine's graphs have it (no allocation or zero fill per call)
    scratch = split_scratch(kv.batch, hq, kv.caches[0][0].shape[1], d, cfg, "cuda")
    fns = [lambda i=i: paged_decode(qs[i], kv.caches[i][0], vcs[i], kv.block_table,
                                    kv.kv_lens, outs[i], d ** -0.5, cfg, window=window,
                                    scratch=scratch,
                                    **scale_kwargs(kv, i))
           for i in range(kv.reps)]
    return triton.testing.do_bench(rotating(fns), warmup=25, rep=150, return_mode="median") * 1e3


def fi_decode_wrappers(kv: KVSet, hq, hkv, d, use_tc, q_dtype):
    import flashinfer
    import torch

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=use_tc)
    indptr = torch.arange(0, kv.batch + 1, dtype=torch.int32, device="cuda") * kv.pages_per_req
    last = torch.full((kv.batch,), (kv.context - 1) % kv.page_size + 1, dtype=torch.int32,
                      device="cuda")
    w.plan(indptr, kv.block_table.flatten(), last, hq, hkv, d, kv.page_size,
           q_data_type=q_dtype, kv_data_type=kv.dtype, sm_scale=d ** -0.5)
    return w, ws


def time_fi_decode(kv: KVSet, hq, hkv, d, use_tc) -> float:
    import torch
    import triton

    w, _ws = fi_decode_wrappers(kv, hq, hkv, d, use_tc, torch.bfloat16)
    qs = [torch.randn(kv.batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in kv.caches]
    outs = [torch.empty_like(q) for q in qs]
    fns = [lambda i=i: w.run(qs[i], kv.caches[i], out=outs[i]) for i in range(kv.reps)]
    return triton.testing.do_bench(rotating(fns), warmup=25, rep=150, return_mode="median") * 1e3


def run_decode(args, device, copy_bw, results):
    import torch

    from kvfit.kernels import decode_8bit_gluon
    from kvfit.kernels.decode import choose_config

    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout in MLA_LAYOUTS:
            run_mla_decode(args, layout, device, copy_bw, results)
            continue
        hq, hkv, d = rank_heads(layout, args.tensor_parallel_size)
        for b in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                row = {}
                for kvd in args.kv_dtypes.split(","):
                    dt = _torch_dtype(kvd)
                    isz = torch.empty((), dtype=dt).element_size()
                    need = 2 * b * ctx * hkv * d * isz
                    if need > args.max_gib * (1 << 30):
                        print(f"skip {layout} {kvd} b={b} ctx={ctx}: {need / 2**30:.1f} GiB")
                        continue
                    kv = KVSet(hkv, d, kvd, b, ctx, page_size(args, kvd, d), device)
                    rec = {"kind": "decode", "layout": layout, "kv_dtype": kvd, "batch": b,
                           "context": ctx, "kv_bytes": kv.bytes, "elements": kv.bytes // isz,
                           "page_size": kv.page_size}
                    v_t = ours_v_layout(kv) == "HDN"
                    rec["ours_v_layout"] = ours_v_layout(kv)
                    # the engine's kernel: the Gluon 8-bit decode where it is the default
                    gluon = decode_8bit_gluon.engine_default(dt, torch.bfloat16, d,
                                                             kv.page_size, v_t, device)
                    cfg = choose_config(b, hkv, hq // hkv, d, ctx, dt, torch.bfloat16, v_t=v_t,
                                        page_size=kv.page_size, gluon=gluon)
                    rec["ours_us"] = time_ours_decode(kv, hq, d, cfg)
                    rec["ours_cfg"] = str(cfg)
                    window = WINDOWS.get(layout)
                    if window:  # the engine's sliding-layer plan: splits from the window
                        cfg_w = choose_config(b, hkv, hq // hkv, d, min(ctx, window), dt,
                                              torch.bfloat16, v_t=v_t)
                        rec["window"] = window
                        rec["swa_us"] = time_ours_decode(kv, hq, d, cfg_w, window)
                        rec["swa_over_full"] = rec["swa_us"] / rec["ours_us"]
                    use_tc = hq // hkv >= 4
                    time_fi_into(rec, args, NO_FI_INT8 if kvd == "int8" else None,
                                 partial(time_fi_decode, kv, hq, hkv, d, use_tc))
                    if "fi_us" in rec:
                        rec["fi_tc"] = use_tc
                    for who in ("ours", "fi"):
                        if f"{who}_us" in rec:
                            t = rec[f"{who}_us"] * 1e-6
                            rec[f"{who}_tbps"] = kv.bytes / t / 1e12
                            rec[f"{who}_pct_copy"] = 100 * kv.bytes / t / copy_bw
                            rec[f"{who}_elem_per_s"] = rec["elements"] / t
                    row[kvd] = rec
                    results.append(rec)
                    del kv
                    torch.cuda.empty_cache()
                    _print_decode(rec)
                if "bfloat16" in row and "fp8_e4m3" in row:
                    for who in ("ours", "fi"):
                        if f"{who}_us" in row["bfloat16"] and f"{who}_us" in row["fp8_e4m3"]:
                            row["fp8_e4m3"][f"{who}_fp8_speedup"] = (
                                row["bfloat16"][f"{who}_us"] / row["fp8_e4m3"][f"{who}_us"])
                    r = row["fp8_e4m3"]
                    print(f"    fp8/bf16 speedup: ours {r.get('ours_fp8_speedup', 0):.2f}x"
                          f"  fi {r.get('fi_fp8_speedup', 0):.2f}x")
                if "int8" in row and "fp8_e4m3" in row:
                    r = row["int8"]
                    r["int8_over_fp8_time"] = r["ours_us"] / row["fp8_e4m3"]["ours_us"]
                    print(f"    int8/fp8 decode time: {r['int8_over_fp8_time']:.3f}")


def _print_decode(r):
    s = (f"decode {r['layout']:>13} {r['kv_dtype']:>9} b={r['batch']:<4} ctx={r['context']:<6}"
         f" ours {r['ours_us']:9.1f} us {r['ours_tbps']:5.2f} TB/s ({r['ours_pct_copy']:4.0f}%)"
         f" {r['ours_elem_per_s']:.2e} el/s")
    if "fi_us" in r:
        s += f" | fi {r['fi_us']:9.1f} us {r['fi_tbps']:5.2f} TB/s"
    if "swa_us" in r:
        s += f" | window {r['window']}: {r['swa_us']:9.1f} us, swa/full {r['swa_over_full']:.2f}"
    print(s, flush=True)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in results if r["kind"] == "decode"]
    layouts = sorted({r["layout"] for r in dec})
    if not layouts:
        return
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        pts = [r for r in dec if r["layout"] == layout]
        for kvd in sorted({r["kv_dtype"] for r in pts}):
            for who, style in (("ours", "-o"), ("fi", "--x")):
                sel = sorted((r["batch"] * r["context"], r[f"{who}_tbps"]) for r in pts
                             if r["kv_dtype"] == kvd and f"{who}_tbps" in r)
                if sel:
                    ax.plot([x for x, _ in sel], [y for _, y in sel], style,
                            label=f"{who} {kvd}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch x context (tokens)")
        ax.set_ylabel("KV TB/s")
        ax.set_title(f"paged decode, {layout}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    """Entry point of ``kvfit bench kernels``; returns the exit status."""
    args = parser().parse_args(argv)
    unknown = set(args.layouts.split(",")) - set(LAYOUTS) - set(MLA_LAYOUTS)
    if unknown:
        print(f"unknown layout(s) {', '.join(sorted(unknown))}; known: "
              f"{', '.join([*LAYOUTS, *MLA_LAYOUTS])}")
        return 2
    refused = tp_refusals(args.layouts.split(","), args.tensor_parallel_size)
    if refused:
        print(f"--tensor-parallel-size {args.tensor_parallel_size}: " + "; ".join(refused))
        return 2
    import torch

    if not torch.cuda.is_available():
        print("kvfit bench kernels needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    if not args.no_fi:
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            print("FlashInfer not installed: timing our kernels only (--no-fi)")
            args.no_fi = True
    t0 = time.time()
    bw = copy_bandwidth(device)
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results: list[dict] = []
    if not args.no_decode:
        run_decode(args, device, bw, results)
    if not args.no_prefill:
        run_prefill(args, device, results)
    meta = {"gpu": torch.cuda.get_device_name(), "copy_bw_bytes_per_s": bw,
            "torch": torch.__version__, "args": vars(args), "seconds": time.time() - t0}
    try:
        import triton

        meta["triton"] = triton.__version__
        import flashinfer as fi

        meta["flashinfer"] = fi.__version__
    except ImportError:
        pass
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "kernels.png"))
    print(f"wrote {args.out}/kernels.json and kernels.png ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
