"""``kvfit bench kernels``: our Triton decode/prefill kernels vs FlashInfer's on identical inputs.

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
our MLA kernels only.
``--tensor-parallel-size N`` times the shapes one rank of an N-GPU group runs (its query heads,
its KV heads: ``parallel/layout.py``; MLA: its query heads over the whole latent).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

from kvfit.bench.kernels_mla import MLA_LAYOUTS, run_mla_decode, run_mla_prefill

LAYOUTS = {"qwen3-1.7b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "smollm2": (9, 3, 64),
           "gemma3-270m": (4, 1, 256), "gemma3-4b": (8, 4, 256), "gemma3-12b": (16, 8, 256)}
DEFAULT_LAYOUTS = ("qwen3-1.7b", "llama-3.1-8b", "smollm2", "deepseek-v2-lite")
# sliding-window layers of a layout: each point also times our kernels with the window (the
# same cache, read only over the last ``window`` tokens) against the full layer at that context
WINDOWS = {"gemma3-270m": 512, "gemma3-4b": 1024, "gemma3-12b": 1024}
L2_BYTES = 60 << 20


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


def rank_heads(layout: str, tp_size: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) one of ``tp_size`` ranks runs for ``layout``."""
    from kvfit.parallel.layout import local_kv_heads

    hq, hkv, d = LAYOUTS[layout]
    return hq // tp_size, local_kv_heads(hkv, tp_size), d


def tp_refusals(layouts: list[str], tp_size: int) -> list[str]:
    """Layouts whose heads do not split over ``tp_size`` ranks, with the reason."""
    from kvfit.parallel.layout import head_refusals

    out = []
    for layout in layouts:
        hq, hkv = (MLA_LAYOUTS[layout][0], 1) if layout in MLA_LAYOUTS else LAYOUTS[layout][:2]
        out += [f"{layout}: {r}" for r in head_refusals(hq, hkv, tp_size)] if tp_size > 1 else []
    return out


def _torch_dtype(name):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "int8": torch.int8}[name]


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus written."""
    import torch
    import triton

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3)


class KVSet:
    """R copies of one paged KV problem: caches [pages, Hkv, P, D], a shared block table."""

    def __init__(self, hkv, d, kv_dtype, batch, context, page_size, device, seed=0):
        import torch

        self.kv_dtype = kv_dtype
        self.dtype = _torch_dtype(kv_dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pages_per_req = -(-context // page_size)
        self.num_pages = batch * pages_per_req + 1
        # KV bytes one call must read (int8: the float16 scale of each token and head too)
        scale_bytes = 2 if self.dtype == torch.int8 else 0
        self.bytes = 2 * batch * context * hkv * (d * itemsize + scale_bytes)
        copy_bytes = 2 * self.num_pages * hkv * page_size * d * itemsize
        self.reps = max(1, min(16, math.ceil(4 * L2_BYTES / copy_bytes)))
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.caches = []
        for _ in range(self.reps):
            pair = []
            for _kv in range(2):
                t = torch.empty((self.num_pages, hkv, page_size, d), dtype=self.dtype, device=device)
                step = max(1, (1 << 27) // (hkv * page_size * d))
                for p0 in range(0, self.num_pages, step):
                    chunk = torch.randn(t[p0:p0 + step].shape, generator=g, device=device)
                    if self.dtype == torch.int8:
                        chunk = chunk.mul_(40).round_().clamp_(-127, 127)
                    t[p0:p0 + step] = chunk.clamp_(-400, 400).to(self.dtype)
                pair.append(t)
            self.caches.append(tuple(pair))
        self.scales = None  # int8: (k, v) float16 scale caches [pages, Hkv, P] per copy
        if self.dtype == torch.int8:
            self.scales = [tuple(torch.rand((self.num_pages, hkv, page_size), generator=g,
                                            device=device).add_(0.5).mul_(0.02).half()
                                 for _ in range(2)) for _ in range(self.reps)]
        perm = torch.randperm(self.num_pages - 1, generator=g, device=device).to(torch.int32) + 1
        self.block_table = perm[: batch * pages_per_req].view(batch, pages_per_req).contiguous()
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.batch, self.context, self.page_size = batch, context, page_size
        self.head_dim = d
        self.pages_per_req = pages_per_req


def rotating(fns):
    """One callable that runs ``fns`` in turn (each call the next copy of the inputs, so timed
    inputs never sit in L2)."""
    state = [0]

    def call():
        fns[state[0] % len(fns)]()
        state[0] += 1

    return call


def page_size(args, kv_dtype: str, head_dim: int) -> int:
    """--page-size, else the page size the engine picks for this KV dtype and head size."""
    from kvfit.attention.triton_backend import TritonBackend

    return args.page_size or TritonBackend.default_page_size(kv_dtype, head_dim)


def ours_v_layout(kv: KVSet) -> str:
    """The V page layout the triton backend asks its pool for at this KV dtype."""
    from kvfit.attention.triton_backend import TritonBackend

    return TritonBackend.v_layout(kv.kv_dtype, kv.page_size, kv.head_dim)


def ours_v_caches(kv: KVSet) -> list:
    """V caches in our backend's layout: HND as filled, or token-minor copies [pages, H, D, P]
    (same values, so both kernels see identical inputs)."""
    if ours_v_layout(kv) == "HND":
        return [c[1] for c in kv.caches]
    if not hasattr(kv, "v_token_minor"):
        kv.v_token_minor = [c[1].transpose(2, 3).contiguous() for c in kv.caches]
    return kv.v_token_minor


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


def scale_kwargs(kv: KVSet, i: int) -> dict:
    """The int8 scale-cache arguments of copy ``i`` (none for other dtypes)."""
    if kv.scales is None:
        return {}
    return {"k_scale_cache": kv.scales[i][0], "v_scale_cache": kv.scales[i][1]}


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
                    cfg = choose_config(b, hkv, hq // hkv, d, ctx, dt, torch.bfloat16, v_t=v_t)
                    rec["ours_us"] = time_ours_decode(kv, hq, d, cfg)
                    rec["ours_cfg"] = str(cfg)
                    window = WINDOWS.get(layout)
                    if window:  # the engine's sliding-layer plan: splits from the window
                        cfg_w = choose_config(b, hkv, hq // hkv, d, min(ctx, window), dt,
                                              torch.bfloat16, v_t=v_t)
                        rec["window"] = window
                        rec["swa_us"] = time_ours_decode(kv, hq, d, cfg_w, window)
                        rec["swa_over_full"] = rec["swa_us"] / rec["ours_us"]
                    if kvd == "int8":
                        rec["fi_error"] = "FlashInfer reads no int8 KV pages"
                    elif not args.no_fi:
                        use_tc = hq // hkv >= 4
                        try:
                            rec["fi_us"] = time_fi_decode(kv, hq, hkv, d, use_tc)
                            rec["fi_tc"] = use_tc
                        except Exception as e:
                            rec["fi_error"] = f"{type(e).__name__}: {e}"[:300]
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


def time_ours_prefill(kv: KVSet, hq, d, q_len, window=None):
    import torch
    import triton

    from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config

    hkv = kv.caches[0][0].shape[1]
    cfg = prefill_config(d, torch.bfloat16, kv.dtype)
    blocks = order_prefill_blocks([q_len] * kv.batch, hq // hkv, cfg.block_m, "cuda")
    cu = torch.arange(0, kv.batch + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(kv.batch * q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    vcs = ours_v_caches(kv)
    v_t = ours_v_layout(kv) == "HDN"
    fns = [lambda i=i: paged_prefill(q, kv.caches[i][0], vcs[i], kv.block_table, cu,
                                     kv.kv_lens, blocks, cfg, out, d ** -0.5, window=window,
                                     v_t=v_t, **scale_kwargs(kv, i))
           for i in range(kv.reps)]
    return triton.testing.do_bench(rotating(fns), warmup=25, rep=150, return_mode="median") * 1e3


def time_fi_prefill(kv: KVSet, hq, d, q_len):
    import flashinfer
    import torch
    import triton

    hkv = kv.caches[0][0].shape[1]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend="fa2")
    qo = torch.arange(0, kv.batch + 1, dtype=torch.int32, device="cuda") * q_len
    indptr = torch.arange(0, kv.batch + 1, dtype=torch.int32, device="cuda") * kv.pages_per_req
    last = torch.full((kv.batch,), (kv.context - 1) % kv.page_size + 1, dtype=torch.int32,
                      device="cuda")
    w.plan(qo, indptr, kv.block_table.flatten(), last, hq, hkv, d, kv.page_size, causal=True,
           sm_scale=d ** -0.5, q_data_type=torch.bfloat16, kv_data_type=kv.dtype)
    q = torch.randn(kv.batch * q_len, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    fns = [lambda i=i: w.run(q, kv.caches[i], out=out) for i in range(kv.reps)]
    return triton.testing.do_bench(rotating(fns), warmup=25, rep=150, return_mode="median") * 1e3


def run_prefill(args, device, results):
    for layout in args.layouts.split(","):
        if layout in MLA_LAYOUTS:
            run_mla_prefill(args, layout, device, results)
            continue
        hq, hkv, d = rank_heads(layout, args.tensor_parallel_size)
        for ctx in map(int, args.prefill_contexts.split(",")):
            b = max(1, 16384 // ctx)
            for kvd in args.kv_dtypes.split(","):
                kv = KVSet(hkv, d, kvd, b, ctx, page_size(args, kvd, d), device)
                flops = b * 4 * hq * d * ctx * (ctx + 1) / 2
                rec = {"kind": "prefill", "layout": layout, "kv_dtype": kvd, "batch": b,
                       "context": ctx, "flops": flops, "page_size": kv.page_size}
                rec["ours_us"] = time_ours_prefill(kv, hq, d, ctx)
                window = WINDOWS.get(layout)
                if window:
                    rec["window"] = window
                    rec["swa_us"] = time_ours_prefill(kv, hq, d, ctx, window)
                    rec["swa_over_full"] = rec["swa_us"] / rec["ours_us"]
                if kvd == "int8":
                    rec["fi_error"] = "FlashInfer reads no int8 KV pages"
                elif not args.no_fi:
                    try:
                        rec["fi_us"] = time_fi_prefill(kv, hq, d, ctx)
                    except Exception as e:
                        rec["fi_error"] = f"{type(e).__name__}: {e}"[:300]
                for who in ("ours", "fi"):
                    if f"{who}_us" in rec:
                        rec[f"{who}_tflops"] = flops / (rec[f"{who}_us"] * 1e-6) / 1e12
                s = (f"prefill {layout:>13} {kvd:>9} b={b:<3} len={ctx:<6} ours "
                     f"{rec['ours_us']:9.1f} us {rec['ours_tflops']:6.1f} TFLOP/s")
                if "fi_us" in rec:
                    s += (f" | fi {rec['fi_us']:9.1f} us {rec['fi_tflops']:6.1f} TFLOP/s"
                          f" | ours/fi time {rec['ours_us'] / rec['fi_us']:.2f}")
                if "swa_us" in rec:
                    s += (f" | window {rec['window']}: {rec['swa_us']:9.1f} us, swa/full "
                          f"{rec['swa_over_full']:.2f}")
                print(s, flush=True)
                results.append(rec)
                del kv


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
