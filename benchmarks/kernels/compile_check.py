"""Compile every launch variant of the int8 / K-centering / rotation / packed kernels for sm_90
without a GPU (ptxas included), so a compile error shows up on the CPU machine instead of in a
GPU round. The host functions run on CPU tensors; each ``kernel[grid](...)`` launch is replaced
by ``triton.compile`` of the same signature and constexprs (nothing executes).

Usage: PYTHONPATH=src python3 benchmarks/kernels/compile_check.py  (prints one line per variant,
exits 1 on any compile failure).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
         torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")
SEEN: dict = {}
FAILED: list = []


def _compile(fn: JITFunction, args, kwargs):
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    for p in fn.params:  # constexprs the launch leaves at their defaults
        if p.is_constexpr and p.name not in values and p.has_default:
            values[p.name] = p.default
    consts = {p.name: values[p.name] for p in fn.params if p.is_constexpr and p.name in values}
    sig, attrs = {}, {}
    nospec = {names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            # as the JIT specialises an int argument: 1 becomes a constant, a multiple of 16
            # carries that divisibility (which decides vectorised and asynchronous loads)
            if name not in nospec and v == 1:
                consts[name] = 1
                sig[name] = "constexpr"
                continue
            sig[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if name not in nospec and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    opts = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    key = (fn.fn.__name__, tuple(sorted((k, repr(v)) for k, v in consts.items())),
           tuple(sorted(sig.items())), tuple(sorted(opts.items())))
    if key in SEEN:
        return
    label = f"{fn.fn.__name__} " + " ".join(f"{k}={v}" for k, v in consts.items()
                                              if not isinstance(v, float))
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                           options=opts)
        SEEN[key] = k
        print(f"ok    {label} regs={getattr(k, 'n_regs', '?')}", flush=True)
    except Exception as e:  # noqa: BLE001 - report every failing variant
        SEEN[key] = None
        FAILED.append(label)
        msg = "".join(traceback.format_exception_only(type(e), e))[-1500:]
        print(f"FAIL  {label}\n{msg}", flush=True)


def _fake_getitem(self, grid):
    return lambda *args, **kwargs: _compile(self, args, kwargs)


def run_variants():
    from kvfit.attention.base import KVStoreTarget
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.kernels.decode import choose_config, paged_decode
    from kvfit.kernels.fused_rope import apply_rope
    from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
    from kvfit.kernels.store import split_store_chunks, store_kv, store_kv_chunks
    from kvfit.kvcache.dtypes import kv_format

    i8 = kv_format("int8")
    for d, (hq, hkv), ps, vl in [(64, (9, 3), 16, "HND"), (128, (16, 8), 32, "HDN"),
                                 (256, (8, 4), 16, "HND"), (128, (32, 8), 16, "HND")]:
        num_pages = 8
        kc = torch.zeros(num_pages, hkv, ps, d, dtype=torch.int8)
        vc = torch.zeros(num_pages, hkv, d, ps, dtype=torch.int8) if vl == "HDN" else \
            torch.zeros_like(kc)
        ks = torch.zeros(num_pages, hkv, ps, dtype=torch.float16)
        vs = torch.zeros_like(ks)
        mu = torch.zeros(hkv, d)
        sc = dict(k_scale_cache=ks, v_scale_cache=vs)
        q_lens, kv_lens = [3, 1], [40, 17]
        meta = build_metadata(q_lens, kv_lens, [[0, 1, 2], [3, 4]], ps, "cpu")
        t = sum(q_lens)
        k = torch.zeros(t, hkv, d, dtype=torch.bfloat16)
        q = torch.zeros(t, hq, d, dtype=torch.bfloat16)
        for mean in (None, mu):
            store_kv(k, k, kc, vc, meta.slot_mapping, i8, v_layout=vl, k_mean=mean, **sc)
            if vl == "HDN":
                for rot in (False, True):
                    store_kv_chunks(k, k, kc, vc, split_store_chunks(q_lens, kv_lens, ps, "cpu"),
                                    meta.cu_seqlens_q, meta.kv_lens, meta.block_table, i8,
                                    k_mean=mean, rotate=rot, **sc)
        cos = torch.ones(64, d)
        pos = torch.zeros(t, dtype=torch.int64)
        for rotate in (False, True):
            tgt = KVStoreTarget(kc, vc, meta.slot_mapping, i8, 1.0, 1.0, vl, k_mean=mu,
                                rotate=rotate, **sc)
            apply_rope(q, k, cos, cos, pos, kv_store=(k, tgt))
        # fp8 with K centering (and the rotating path, generic)
        f8 = kv_format("fp8_e4m3")
        kc8 = kc.view(torch.float8_e4m3fn)
        vc8 = vc.view(torch.float8_e4m3fn)
        store_kv(k, k, kc8, vc8, meta.slot_mapping, f8, 0.5, 2.0, vl, k_mean=mu)
        apply_rope(q, k, cos, cos, pos, kv_store=(k, KVStoreTarget(kc8, vc8, meta.slot_mapping,
                                                                   f8, 0.5, 2.0, vl,
                                                                   k_mean=mu)))
        # decode: every int8 conversion, split and single, packed where the group fits
        dq = torch.zeros(2, hq, d, dtype=torch.bfloat16)
        dmeta = build_metadata([1, 1], kv_lens, [[0, 1, 2], [3, 4]], ps, "cpu")
        out = torch.empty_like(dq)
        qb = torch.zeros(2, hq)
        base = choose_config(2, hkv, hq // hkv, d, 40, torch.int8, dq.dtype, v_t=vl == "HDN")
        for cvt in ("asm", "bias", "cast", "kbias", "imma", "imma-bias", "imma1"):
            for splits, fused in ((1, False), (2, False), (2, True)):  # fused: merge in-kernel
                cfg = dataclasses.replace(base, i8_cvt=cvt, num_splits=splits,
                                          fused_merge=fused)
                paged_decode(dq, kc, vc, dmeta.block_table, dmeta.kv_lens, out, d ** -0.5, cfg,
                             **sc)
                paged_decode(dq, kc, vc, dmeta.block_table, dmeta.kv_lens, out, d ** -0.5, cfg,
                             softcap=20.0, window=16, q_bias=qb, **sc)
        fma = choose_config(2, hkv, hq // hkv, d, 40, torch.int8, dq.dtype, use_dot=False,
                            v_t=vl == "HDN")
        paged_decode(dq, kc, vc, dmeta.block_table, dmeta.kv_lens, out, d ** -0.5, fma,
                     softcap=20.0, q_bias=qb, **sc)
        g = hq // hkv
        if vl == "HND" and g <= 4 and d <= 128:
            pack = 16 // triton.next_power_of_2(g)
            for dt, kw in ((torch.int8, sc), (torch.float8_e4m3fn, {}), (torch.bfloat16, {})):
                kk = kc.view(dt) if dt != torch.bfloat16 else torch.zeros(num_pages, hkv, ps, d,
                                                                         dtype=dt)
                cfgp = dataclasses.replace(choose_config(2, hkv, g, d, 40, dt, dq.dtype),
                                           pack=pack, block_n=128, i8_cvt="asm")
                for cvt in (("asm", "bias", "cast") if dt == torch.int8 else ("asm",)):
                    paged_decode(dq, kk, kk, dmeta.block_table, dmeta.kv_lens, out, d ** -0.5,
                                 dataclasses.replace(cfgp, i8_cvt=cvt), **kw)
                paged_decode(dq, kk, kk, dmeta.block_table, dmeta.kv_lens, out, d ** -0.5,
                             cfgp, softcap=20.0, window=16, q_bias=qb, **kw)
        # prefill
        cfg = prefill_config(d, q.dtype, torch.int8)
        blocks = order_prefill_blocks(q_lens, hq // hkv, cfg.block_m, "cpu", kv_lens)
        pout = torch.empty_like(q)
        for rot in (False, True):
            paged_prefill(q, kc, vc, meta.block_table, meta.cu_seqlens_q, meta.kv_lens, blocks,
                          cfg, pout, d ** -0.5, v_t=vl == "HDN", rotate_q=rot, **sc)
        paged_prefill(q, kc, vc, meta.block_table, meta.cu_seqlens_q, meta.kv_lens, blocks, cfg,
                      pout, d ** -0.5, softcap=20.0, window=16, v_t=vl == "HDN",
                      q_bias=torch.zeros(t, hq), **sc)


def main():
    JITFunction.__getitem__ = _fake_getitem
    run_variants()
    print(f"{len(SEEN)} variants compiled for sm_90, {len(FAILED)} failed")
    if FAILED:
        print("failed: " + "; ".join(FAILED))
        sys.exit(1)


if __name__ == "__main__":
    main()
