"""Launch one prefill variant a few times at 4 x 4096 (Qwen3-1.7B heads, causal, empty prefix)
for ncu. Usage: ncu ... python3 ncu_prefill.py {bf16|bf16_s2|fp8|fp8_s2}
(bf16/fp8: the chosen launch, 5 stages; *_s2: 2 stages, the tile loads not overlapped)"""

import sys

import torch

from kvfit.bench.kernels_common import KVSet, ours_v_caches, ours_v_layout
from kvfit.kernels.prefill import (PrefillConfig, order_prefill_blocks, paged_prefill,
                                   prefill_config)

which = sys.argv[1]
kvd = "bfloat16" if which.startswith("bf16") else "fp8_e4m3"
page = 16 if kvd == "bfloat16" else 32
b, n, hq, hkv, d = 4, 4096, 16, 8, 128
kv = KVSet(hkv, d, kvd, b, n, page, "cuda")
cfg = prefill_config(d, torch.bfloat16, kv.dtype)
if which.endswith("_s2"):
    cfg = PrefillConfig(cfg.block_m, cfg.block_n, cfg.num_warps, 2)
vt = ours_v_layout(kv) == "HDN"
vcs = ours_v_caches(kv)
blocks = order_prefill_blocks([n] * b, hq // hkv, cfg.block_m, "cuda")
cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * n
q = torch.randn(b * n, hq, d, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for i in range(5):
    paged_prefill(q, kv.caches[i % kv.reps][0], vcs[i % kv.reps], kv.block_table, cu, kv.kv_lens,
                  blocks, cfg, out, d ** -0.5, v_t=vt)
torch.cuda.synchronize()
print(which, cfg, "v_t" if vt else "HND", f"page {page}")
