"""Decode attention time, int4 pool (kernels/decode_int4.py) against fp8_e4m3 (kernels/decode.py,
the triton backend's layout and launch choice), on the same shapes (batch x context >= 128k
tokens). Prints one table; --json writes the rows.

    python3 benchmarks/kernels/int4_decode_bench.py [--json out.json]
    python3 benchmarks/kernels/int4_decode_bench.py --sweep [--json sweep.json]

``--sweep`` times every launch variant of ``VARIANTS`` (pages per tile, warps, pipeline stages,
asm or cast nibble conversion, programs per SM assumed by the split rule) per shape and prints
the compiled registers and shared memory of each, plus each variant's largest difference from
the cast variant's output (a check that the asm conversion computes the same values).
``--gluon`` and ``--regs`` time the Gluon kernels (the register one over the same pages with
token-minor V). ``--compile-only --part I --parts N`` compiles the I-th of N slices of the same
launches without timing them (run N of those in parallel first: the timed run then hits
Triton's cache).

Bytes are what one call must read: fp8 2 x D per token and head; int4 the packed codes, K's
scale/zero per page and V's per token group (5D/4 per token and head) plus the residual page.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

SHAPES = [  # (name, Hq, Hkv, D, batch, context)
    ("qwen3-1.7b-like", 16, 8, 128, 64, 2048),
    ("qwen3-1.7b-like", 16, 8, 128, 16, 8192),
    ("smollm2-like", 9, 3, 64, 64, 2048),
    ("gemma3-like", 4, 1, 256, 128, 1024),
    ("qwen3-1.7b-like", 16, 8, 128, 4, 32768),
]
# per head size: (pages per tile, warps, stages, asm, programs per SM in the split rule,
# register cap, K's scale folded into q, K's scale loaded per token); the first (cast) is the
# reference of the max diff column
VARIANTS = {
    64: [(2, 4, 3, False, 2, None, False, False), (2, 4, 3, True, 4, 96, False, True),
         (2, 4, 3, True, 4, 96, False, False), (2, 4, 1, True, 4, None, False, False),
         (4, 4, 3, True, 2, None, False, True)],
    128: [(2, 4, 3, False, 2, None, False, False), (2, 4, 3, True, 2, None, False, True),
          (2, 4, 3, True, 2, None, False, False), (2, 4, 2, True, 2, None, False, False),
          (2, 4, 1, True, 2, None, False, False), (2, 4, 1, True, 2, None, False, True),
          (4, 8, 1, True, 2, None, False, False)],
    256: [(2, 4, 2, False, 2, None, False, False), (2, 8, 2, True, 2, None, False, False),
          (2, 8, 1, True, 2, None, False, False)],
}
DUMP_VARIANTS = []


def _table(batch, pages_per_req, dev, g):
    n = batch * pages_per_req
    perm = torch.randperm(n, generator=g, device=dev).to(torch.int32)
    return perm.view(batch, pages_per_req).contiguous(), n


def setup_fp8(hq, hkv, d, batch, ctx, dev, g):
    """(launch closure, bytes read, page size) of the fp8 decode on one shape."""
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
    sms = _sms(dev)
    cfg = choose_config(batch, hkv, hq // hkv, d, ctx, k.dtype, q.dtype, sms,
                        v_t=layout == "HDN")
    fn = lambda: paged_decode(q, k, v, bt, lens, out, d ** -0.5, cfg)  # noqa: E731
    return fn, 2 * batch * ctx * hkv * d, ps


def setup_int4(hq, hkv, d, batch, ctx, dev, g):
    """(run(cfg, token_minor) -> out, bytes read, compiled(cfg, token_minor)) of the int4
    decode on one shape (``token_minor``: over the pool with token-minor V pages)."""
    from kvfit.kernels import decode_int4
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.int4_pool import Int4KVCache
    from kvfit.kvcache.kivi import v_token_minor
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
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)

    # the same pages with token-minor V (the register kernel's pool, v_layout "HDN")
    tm = Int4KVCache([KVLayerSpec("full", hkv, d)], n, 32, kv_format("int4"), dev,
                     num_slots=batch, residual_dtype=torch.bfloat16, v_layout="HDN")
    for name in ("k_caches", "k_scale_caches", "k_zero_caches", "k_residual", "v_residual"):
        getattr(tm, name)[0].copy_(getattr(pool, name)[0])
    for dst, src in zip((tm.v_caches, tm.v_scale_caches, tm.v_zero_caches),
                        v_token_minor(pool.v_caches[0], pool.v_scale_caches[0],
                                      pool.v_zero_caches[0])):
        dst[0].copy_(src)

    def run(cfg, token_minor=False):
        out = torch.empty_like(q)
        decode_int4.int4_decode(q, tm if token_minor else pool, 0, bt, lens, slots, out,
                                d ** -0.5, cfg)
        return out

    def compiled(cfg, token_minor=False):
        out = torch.empty_like(q)
        op = torch.empty((batch * hq * cfg.num_splits, d), dtype=torch.float32, device=dev)
        lse = torch.empty((batch * hq * cfg.num_splits,), dtype=torch.float32, device=dev)
        kern, grid, args, opts = decode_int4._launch(q, tm if token_minor else pool, 0, bt,
                                                     lens, slots, out, op, lse, d ** -0.5, cfg)
        return kern.warmup(*args, grid=grid, **opts)

    tail = ctx - full * 32
    nbytes = batch * hkv * (full * 32 * d * 5 // 4 + 2 * tail * d * 2)
    return run, nbytes, compiled


def is_regs(variant) -> bool:
    """A variant of the register kernel (it runs over the token-minor V pool)."""
    return isinstance(variant, tuple) and variant[0] == "regs"


def variant_cfg(variant, batch, hkv, d, ctx, sms):
    from kvfit.kernels.decode_int4 import Int4DecodeConfig, choose_config

    if variant is None:
        return choose_config(batch, hkv, d, ctx, sms)
    if variant == "gluon":
        return choose_config(batch, hkv, d, ctx, sms, gluon=True)
    if variant[0] == "regs":  # ("regs"[, programs per SM, register cap, K scales ahead,
        # tiles asked of L2 ahead])
        cfg = choose_config(batch, hkv, d, ctx, sms, gluon=True, v_t=True)
        if len(variant) > 1:
            per_sm, maxnreg, ahead, l2 = (list(variant[1:]) + [0, 0, 0])[:4]
            cfg = choose_config(batch, hkv, d, ctx, sms, ctas_per_sm=per_sm, gluon=True,
                                v_t=True)
            cfg = dataclasses.replace(cfg, maxnreg=maxnreg or None, ks_ahead=bool(ahead),
                                      l2_ahead=l2)
        return cfg
    if variant[0] == "gluon":  # ("gluon", stages, programs per SM[, register cap])
        stages, per_sm, maxnreg = (list(variant[1:]) + [0])[:3]
        cfg = choose_config(batch, hkv, d, ctx, sms, None, None, stages, per_sm, gluon=True)
        return dataclasses.replace(cfg, maxnreg=maxnreg or None)
    npg, warps, stages, asm, per_sm, maxnreg, fold, ks_tokens = variant
    base = choose_config(batch, hkv, d, ctx, sms, npg, warps, stages, per_sm)
    return Int4DecodeConfig(base.num_splits, npg, warps, stages, asm, maxnreg, fold, ks_tokens)


def _sms(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 132


def _resources(ck) -> tuple:
    """(registers per thread, shared KB) of a CompiledKernel (Triton 3.6 sets ``n_regs`` when
    its handles are loaded); (0, 0) without one."""
    if ck is None:
        return 0, 0
    try:
        ck._init_handles()
    except Exception:  # noqa: BLE001  (a Triton without it: report what is there)
        pass
    return getattr(ck, "n_regs", 0), ck.metadata.shared / 1024


GRAPH = False  # --graph: time CUDA-graph replays (GPU time only, as the engine's decode runs)


def _bench(fn):
    import triton

    if not torch.cuda.is_available():  # --smoke under the interpreter: run once, no timing
        fn()
        return 1.0
    if GRAPH:
        from kvfit.bench.kernels_common import graph_us

        return graph_us([fn] * 4) / 1e3  # ms per call
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="time every launch variant")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--part", type=int, default=0)
    p.add_argument("--parts", type=int, default=1)
    p.add_argument("--dump", default=None,
                   help="folder: write the SASS of the variants in DUMP_VARIANTS per shape")
    p.add_argument("--only", type=int, default=None, help="run only SHAPES[ONLY] (for ncu)")
    p.add_argument("--gluon", action="store_true",
                   help="time the Gluon kernel (decode_int4_gluon) after the default launch")
    p.add_argument("--gluon-variants", default="",
                   help="STAGES:PER_SM[:MAXNREG],... Gluon launches to time too (stages, "
                        "programs per SM assumed by the split rule, register cap)")
    p.add_argument("--gluon-from", default=None, metavar="FILE",
                   help="A/B of kernel versions: the Gluon kernel built by FILE's build() (e.g. "
                        "`git show REV:src/kvfit/kernels/decode_int4_gluon.py > FILE`) in place "
                        "of decode_int4_gluon's; the launch is chosen as for the current one")
    p.add_argument("--regs", default=None, nargs="?", const="",
                   help="time the register kernel (decode_int4_regs_kernel) over the same pages "
                        "with token-minor V; optional PER_SM:MAXNREG[:AHEAD[:L2]],... launches "
                        "to time too (AHEAD 1: K's scales loaded a tile ahead; L2: tiles ahead "
                        "whose lines are asked of L2, 0 none)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, TRITON_INTERPRET=1: tiny shapes, every code path once, no timing")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of 4 calls (no host launch time) instead of "
                        "do_bench's launches")
    args = p.parse_args()
    if args.gluon_from:
        import importlib.util

        from kvfit.kernels import decode_int4_gluon

        spec = importlib.util.spec_from_file_location("int4_gluon_under_test", args.gluon_from)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        decode_int4_gluon.build = other.build
        print(f"Gluon kernel from {args.gluon_from}", flush=True)
    global GRAPH
    GRAPH = args.graph
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        SHAPES[:] = [("tiny", 4, 2, 64, 2, 200)]
    if args.only is not None:
        SHAPES[:] = [SHAPES[args.only]]
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    sms = _sms(dev)
    def variants_of(shape):
        gv = [("gluon", *map(int, x.split(":"))) for x in args.gluon_variants.split(",") if x]
        rv = ([("regs",)] + [("regs", *map(int, x.split(":"))) for x in args.regs.split(",") if x]
              if args.regs is not None else [])
        return ((VARIANTS[shape[3]] if args.sweep else [None]) + (["gluon"] if args.gluon else [])
                + gv + rv)

    jobs = [(s, None) for s in SHAPES] + [(s, v) for s in SHAPES for v in variants_of(s)]
    if args.compile_only:  # jobs: fp8 per shape, then the int4 variants; every parts-th
        for i, (shape, v) in enumerate(jobs):
            if i % args.parts != args.part:
                continue
            _, hq, hkv, d, b, ctx = shape
            if i < len(SHAPES):
                setup_fp8(hq, hkv, d, b, ctx, dev, g)[0]()
            else:
                run, _, _ = setup_int4(hq, hkv, d, b, ctx, dev, g)
                run(variant_cfg(v, b, hkv, d, ctx, sms), is_regs(v))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return
    rows = []
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (smoke)"
    print(f"GPU: {gpu}; bf16 queries; "
          f"{'CUDA-graph replays' if GRAPH else 'median of do_bench'}")
    print("| shape | Hq/Hkv/D | batch x context | int4 launch | fp8 us | fp8 TB/s | int4 us | "
          "int4 TB/s | int4 speedup | regs / smem KB | max diff |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    for name, hq, hkv, d, b, ctx in SHAPES:
        fp8_fn, f_bytes, ps = setup_fp8(hq, hkv, d, b, ctx, dev, g)
        f_ms = _bench(fp8_fn)
        run, i_bytes, compiled = setup_int4(hq, hkv, d, b, ctx, dev, g)
        base = None
        for v in variants_of((name, hq, hkv, d, b, ctx)):
            cfg, tmv = variant_cfg(v, b, hkv, d, ctx, sms), is_regs(v)
            out = run(cfg, tmv)
            if base is None:
                base = out.float()
            diff = float((out.float() - base).abs().max() / base.abs().max())
            i_ms = _bench(lambda: run(cfg, tmv))  # noqa: B023
            try:
                ck = compiled(cfg, tmv) if dev.type == "cuda" else None
            except Exception as e:  # noqa: BLE001  (a kernel object without warmup: no counts)
                print(f"no compiled kernel for {cfg}: {type(e).__name__}: {e}")
                ck = None
            regs, smem = _resources(ck)
            launch = ("regs " if tmv else "gluon " if cfg.gluon else "") + (
                      f"S={cfg.num_splits} NPG={cfg.pages_per_tile} w={cfg.num_warps} "
                      f"st={cfg.num_stages} {'asm' if cfg.asm else 'cast'}"
                      + (f" r{cfg.maxnreg}" if cfg.maxnreg else "")
                      + (" foldK" if cfg.fold_k else "") + (" ksT" if cfg.ks_tokens else "")
                      + (" ksA" if cfg.ks_ahead else "")
                      + (f" L2+{cfg.l2_ahead}" if cfg.l2_ahead else ""))
            row = dict(shape=name, hq=hq, hkv=hkv, d=d, batch=b, context=ctx, fp8_page=ps,
                       launch=launch, fp8_us=f_ms * 1e3, int4_us=i_ms * 1e3,
                       fp8_tbs=f_bytes / f_ms / 1e9, int4_tbs=i_bytes / i_ms / 1e9,
                       speedup=f_ms / i_ms, regs=regs, smem_kb=smem,
                       max_diff=diff)
            rows.append(row)
            if args.dump and ck is not None and v in DUMP_VARIANTS:
                import os

                os.makedirs(args.dump, exist_ok=True)
                tag = f"{name}-b{b}-d{d}-npg{cfg.pages_per_tile}-w{cfg.num_warps}"
                try:
                    with open(os.path.join(args.dump, tag + ".sass"), "w") as f:
                        f.write(ck.asm["sass"])
                except Exception as e:  # noqa: BLE001  (cuobjdump missing: note it, go on)
                    print(f"no SASS for {tag}: {e}")
            print(f"| {name} | {hq}/{hkv}/{d} | {b} x {ctx} | {launch} | {row['fp8_us']:.1f} | "
                  f"{row['fp8_tbs']:.2f} | {row['int4_us']:.1f} | {row['int4_tbs']:.2f} | "
                  f"{row['speedup']:.2f}x | {regs} / {smem:.0f} | "
                  f"{diff:.1e} |", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
