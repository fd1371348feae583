"""Prefill launch variants on the GPU against FlashInfer fa2, on identical inputs.

For each (layout, prompt length, KV dtype): FlashInfer's time once, then ours for each
(BLOCK_M, BLOCK_N, num_warps, num_stages) variant after a correctness check against FlashInfer's
output. Prints ours/fi time ratios; writes $OUT/explore_prefill.json.
"""

import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../src"))
from kvfit.bench.kernels_common import (LAYOUTS, KVSet, ours_v_caches,  # noqa: E402
                                        ours_v_layout)
from kvfit.bench.kernels_prefill import time_fi_prefill  # noqa: E402
from kvfit.attention.triton_backend import TritonBackend  # noqa: E402
from kvfit.kernels.prefill import PrefillConfig, order_prefill_blocks, paged_prefill  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages, V layout: None = the backend's, "HND" = forced)
# Triton overlaps the indirect (block-table) tile loads with compute only from 5 stages up:
# below that each tile's loads are issued after the previous tile's MMAs and waited at once.
VARIANTS = [(64, 64, 4, 2, None), (128, 64, 8, 3, None), (64, 64, 4, 5, None),
            (128, 64, 8, 5, None), (128, 64, 8, 5, "HND"),
            (128, 32, 8, 6, None)]
VARIANTS_256 = [(64, 32, 4, 2, None), (64, 32, 8, 2, None), (64, 32, 8, 5, None),
                (128, 32, 8, 2, None), (64, 32, 8, 5, "HND")]
HEAD_LAYOUTS = dict(LAYOUTS, **{"gemma3-4b": (8, 4, 256)})
LAYOUT_NAMES = os.environ.get("LAYOUTS", "qwen3-1.7b,llama-3.1-8b,smollm2").split(",")
REF = PrefillConfig(64, 32, 4, 2)  # every variant's output is compared with this launch's
CTXS = tuple(int(x) for x in os.environ.get("CTXS", "1024,4096,16384").split(","))


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    res = []
    t0 = time.time()
    for layout in LAYOUT_NAMES:
        hq, hkv, d = HEAD_LAYOUTS[layout]
        for ctx in CTXS:
            b = max(1, 16384 // ctx)
            for kvd in ("bfloat16", "fp8_e4m3"):
                page = int(os.environ.get("PAGE", 0)) or TritonBackend.default_page_size(kvd, d)
                kv = KVSet(hkv, d, kvd, b, ctx, page, "cuda")
                flops = b * 4 * hq * d * ctx * (ctx + 1) / 2
                fi_us = (float("nan") if os.environ.get("NO_FI")
                         else time_fi_prefill(kv, hq, d, ctx))
                v_t = ours_v_layout(kv) == "HDN"
                vcs = ours_v_caches(kv)
                cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * ctx
                q = torch.randn(b * ctx, hq, d, device="cuda", dtype=torch.bfloat16)
                ref = torch.empty_like(q)
                paged_prefill(q, kv.caches[0][0], vcs[0], kv.block_table, cu, kv.kv_lens,
                              order_prefill_blocks([ctx] * b, hq // hkv, REF.block_m, "cuda"),
                              REF, ref, d ** -0.5, v_t=v_t)
                for bm, bn, nw, ns, lay in (VARIANTS_256 if d > 128 else VARIANTS):
                    if lay == "HND" and not v_t:
                        continue
                    vt = v_t and lay != "HND"
                    vc_i = vcs if vt else [c[1] for c in kv.caches]
                    blocks = order_prefill_blocks([ctx] * b, hq // hkv, bm, "cuda")
                    out = torch.full_like(q, float("nan"))

                    def run(i, out=out, blocks=blocks, bm=bm, bn=bn, nw=nw, ns=ns, vt=vt,
                            vc_i=vc_i):
                        paged_prefill(q, kv.caches[i][0], vc_i[i], kv.block_table, cu,
                                      kv.kv_lens, blocks, PrefillConfig(bm, bn, nw, ns), out,
                                      d ** -0.5, v_t=vt)
                    try:
                        run(0)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        state = [0]

                        def call():
                            run(state[0] % kv.reps)
                            state[0] += 1
                        us = triton.testing.do_bench(call, warmup=10, rep=60,
                                                     return_mode="median") * 1e3
                    except Exception as e:
                        print(f"{layout} {kvd} {ctx} {(bm, bn, nw, ns, lay)} failed: {e}"[:300])
                        continue
                    rec = dict(layout=layout, kv=kvd, ctx=ctx, batch=b, page=page, bm=bm, bn=bn,
                               nw=nw, ns=ns, v_layout="HDN" if vt else "HND", us=us, fi_us=fi_us,
                               ratio=us / fi_us, err=err, tflops=flops / us / 1e6)
                    res.append(rec)
                    print(f"{layout:>12} {kvd:>8} len={ctx:<5} bm={bm:<3} bn={bn:<3} w={nw} s={ns}"
                          f" {rec['v_layout']} p{page}"
                          f" {us:8.1f} us {rec['tflops']:5.0f} TFLOP/s fi {fi_us:8.1f} us"
                          f" ours/fi {us / fi_us:.2f} err-vs-default {err:.1e}"
                          f" [{time.time() - t0:.0f}s]", flush=True)
                del kv
                torch.cuda.empty_cache()
                with open(os.path.join(out_dir, "explore_prefill.json"), "w") as f:
                    json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
