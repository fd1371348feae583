"""Launch one decode variant a few times at batch 32 x 16k (Qwen3-1.7B heads) for ncu.
Usage: ncu ... python3 ncu_decode.py {bf16|fp8_v1|fp8_v2}"""

import sys

import torch

from kvfit.bench.kernels import KVSet
from kvfit.kernels.decode import choose_config, paged_decode

which = sys.argv[1]
kvd = "bfloat16" if which == "bf16" else "fp8_e4m3"
kv = KVSet(8, 128, kvd, 32, 16384, 16, "cuda")
cfg = choose_config(32, 8, 2, 128, 16384, kv.dtype, torch.bfloat16,
                    v_pairs=which == "fp8_v2")
q = torch.randn(32, 16, 128, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for i in range(6):
    paged_decode(q, kv.caches[i % kv.reps][0], kv.caches[i % kv.reps][1], kv.block_table,
                 kv.kv_lens, out, 128 ** -0.5, cfg)
torch.cuda.synchronize()
print(which, cfg)
