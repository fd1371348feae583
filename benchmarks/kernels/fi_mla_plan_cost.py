"""Host time of one FlashInfer MLA plan (the fi backend re-plans its decode wrapper before every
step, outside the CUDA graph) at decode batch sizes, V2-Lite heads, 16k contexts, pages of 16:
eager wrapper and CUDA-graph wrapper (static metadata buffers), each through the wrapper's public
``plan`` (what the fi backend calls) and through its FA backend object's own ``plan`` (FlashInfer
0.7's private ``_planned_backend``: 2.5-3x less host time, but no end-to-end gain measured, so
the backend does not use it; docs/benchmarks.md "MLA through FlashInfer"), median of 50 plans.

    PYTHONPATH=src python3 benchmarks/kernels/fi_mla_plan_cost.py [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=16384)
    args = p.parse_args()
    import torch
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    dev = torch.device("cuda")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    page = 16
    kernel = "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    for b in map(int, args.batches.split(",")):
        pages = -(-args.context // page)
        indices = torch.arange(b * pages, dtype=torch.int32, device=dev)
        cu = torch.arange(b + 1, dtype=torch.int32)
        meta = MLAPlanMetadata.csr(cu, cu * pages, indices,
                                   torch.full((b,), args.context, dtype=torch.int32))

        def buf(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        for mode in ("eager", "graph"):
            kw = {}
            if mode == "graph":
                kw = dict(use_cuda_graph=True, qo_indptr=buf(b + 1), kv_indptr=buf(b + 1),
                          kv_indices=buf(b * pages), kv_len_arr=buf(b))
            w = BatchMLAPagedAttentionWrapper(ws, backend=kernel, **kw)
            common = dict(num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=page,
                          causal=False, sm_scale=0.1, q_data_type=torch.bfloat16,
                          kv_data_type=torch.bfloat16)
            for path in ("wrapper", "backend"):
                times = []
                for _ in range(55):
                    t0 = time.perf_counter()
                    if path == "wrapper":
                        w.plan(metadata=meta, **common)
                    else:
                        w._planned_backend.plan(
                            qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr,
                            kv_indices=meta.kv_indices, kv_len_arr=meta.kv_len_arr,
                            output_dtype=torch.bfloat16, scale_mode="default",
                            use_profiler=False, **common)
                    times.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                print(f"batch {b:3d} {mode:5s} {path:7s} plan: "
                      f"{statistics.median(times[5:]) * 1e6:8.1f} us host (median of 50)",
                      flush=True)


if __name__ == "__main__":
    main()
