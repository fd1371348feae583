"""The prefill points of ``kvfit bench kernels``: our paged prefill kernel against FlashInfer's
fa2 prefill on the same pages, a whole causal prompt per request (empty prefix), TFLOP/s; Gemma 3
layouts also over their sliding window; MLA layouts through bench/kernels_mla.py."""

from __future__ import annotations

from functools import partial

from kvfit.bench.kernels_common import (NO_FI_INT8, WINDOWS, KVSet, ours_v_caches, ours_v_layout,
                                        page_size, rank_heads, rotating, scale_kwargs,
                                        time_fi_into)
from kvfit.bench.kernels_mla import MLA_LAYOUTS, run_mla_prefill


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
                time_fi_into(rec, args, NO_FI_INT8 if kvd == "int8" else None,
                             partial(time_fi_prefill, kv, hq, d, ctx))
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
