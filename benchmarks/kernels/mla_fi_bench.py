"""FlashInfer's MLA decode against ours on the DeepSeek-V2-Lite shape (16 heads, rank 512 + rope
64), bf16 and fp8_e4m3 latents: is FlashInfer's MLA kernel (``BatchMLAPagedAttentionWrapper``,
FA3 on Hopper) a faster decode path for the ``fi`` backend over ``MLAKVCache``?

    PYTHONPATH=src python3 benchmarks/kernels/mla_fi_bench.py \
        --points bfloat16:4:32768,fp8_e4m3:4:32768,bfloat16:32:16384,fp8_e4m3:32:16384

Per point: one paged latent cache ``[pages, P, 576]`` (the pool's own layout, pages scattered,
copies rotated so that no call finds its latents in L2), our ``mla_decode`` at
``decode_config``'s launch and FlashInfer's wrapper planned once, each timed as CUDA-graph
replays of one call per copy (no host launch time), median of 5; latent TB/s = latent bytes a
call must read / time, against the copy bandwidth measured in the run. Before timing, both
outputs are compared with a float64 reference over the same pages (request 0; relative
Frobenius error). Prints one table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json


def reference(q, cache, table_row, length, rank, sm_scale, scale):
    """float64 softmax(q . slab * sm_scale) @ slab[:rank] for one request, q [H, slab]."""
    import torch

    page = cache.shape[1]
    pages = table_row[: -(-length // page)].long()
    slabs = cache[pages].reshape(-1, cache.shape[-1])[:length].double() * scale  # [L, slab]
    s = (q.double() @ slabs.T) * sm_scale  # [H, L]
    return torch.softmax(s, dim=-1) @ slabs[:, :rank]  # [H, rank]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="bfloat16:4:32768,fp8_e4m3:4:32768,"
                                       "bfloat16:32:16384,fp8_e4m3:32:16384")
    p.add_argument("--page-size", type=int, default=None,
                   help="default: the pool's (16 for bf16, 32 for fp8)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch
    import flashinfer

    from kvfit.bench.kernels_common import copy_bandwidth, graph_us
    from kvfit.bench.kernels_mla import LatentSet, fi_mla_decode_calls
    from kvfit.kernels.mla import decode_config, mla_decode

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"FlashInfer {flashinfer.__version__}", flush=True)
    heads, rank, sm_scale = args.heads, 512, 0.1
    rows = []
    for point in args.points.split(","):
        kvd, b, ctx = point.split(":")
        b, ctx = int(b), int(ctx)
        page = args.page_size or (32 if kvd.startswith("fp8") else 16)
        ls = LatentSet(rank, 64, kvd, b, ctx, page, "cuda")
        q = torch.randn(b, heads, ls.slab, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        ref = reference(q[0], ls.caches[0], ls.block_table[0], ctx, rank, sm_scale, 1.0)
        # ours
        cfg = decode_config(b, heads, rank, ctx, ls.dtype, torch.bfloat16)
        outs = [torch.empty(b, heads, rank, device=dev, dtype=torch.bfloat16)
                for _ in range(ls.reps)]
        s = cfg.num_splits
        scratch = (torch.empty((b * heads * s, rank), dtype=torch.float32, device=dev),
                   torch.empty((b * heads * s,), dtype=torch.float32, device=dev))
        ours = [lambda i=i: mla_decode(q, ls.caches[i], ls.block_table, cu, ls.kv_lens, outs[i],
                                       rank, sm_scale, cfg,
                                       scratch=scratch if s > 1 else None)
                for i in range(ls.reps)]
        ours[0]()
        torch.cuda.synchronize()
        err = rel(outs[0][0], ref)
        us = graph_us(ours)
        tb = ls.bytes / (us * 1e-6) / 1e12
        rows.append(dict(kv_dtype=kvd, batch=b, context=ctx, page=page, impl="ours (triton)",
                         us=us, tbps=tb, pct_copy=100 * tb * 1e12 / bw, rel_err=err))
        print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} P={page:<3} {'ours (triton)':>14} {us:8.1f} us "
              f"{tb:5.2f} TB/s ({100 * tb * 1e12 / bw:3.0f}% of copy) rel err {err:.1e}",
              flush=True)
        # FlashInfer (the fi backend's kernel: FA3 on Hopper)
        fouts = [torch.empty(b, heads, rank, device=dev, dtype=torch.bfloat16)
                 for _ in range(ls.reps)]
        calls = fi_mla_decode_calls(ls, heads, q, fouts, sm_scale)
        calls[0]()
        torch.cuda.synchronize()
        err, agree = rel(fouts[0][0], ref), rel(fouts[0], outs[0])
        us = graph_us(calls)
        tb = ls.bytes / (us * 1e-6) / 1e12
        rows.append(dict(kv_dtype=kvd, batch=b, context=ctx, page=page, impl="fi", us=us,
                         tbps=tb, pct_copy=100 * tb * 1e12 / bw, rel_err=err, vs_ours=agree))
        print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} P={page:<3} {'fi':>14} {us:8.1f} us "
              f"{tb:5.2f} TB/s ({100 * tb * 1e12 / bw:3.0f}% of copy) rel err {err:.1e}, "
              f"vs ours {agree:.1e}", flush=True)
        del ls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
