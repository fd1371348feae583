"""Launch one decode variant a few times at batch 32 x 16k (Qwen3-1.7B heads) for ncu.
Usage: ncu ... python3 ncu_decode.py {bf16|fp8_hnd|fp8_vt}"""

import sys

import torch

from kvfit.bench.kernels import KVSet
from kvfit.kernels.decode import choose_config, paged_decode

which = sys.argv[1]
kvd = "bfloat16" if which == "bf16" else "fp8_e4m3"
kv = KVSet(8, 128, kvd, 32, 16384, 16, "cuda")
vt = which == "fp8_vt"
cfg = choose_config(32, 8, 2, 128, 16384, kv.dtype, torch.bfloat16, v_t=vt)
vcs = [c[1].transpose(2, 3).contiguous() if vt else c[1] for c in kv.caches]
q = torch.randn(32, 16, 128, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for i in range(6):
    paged_decode(q, kv.caches[i % kv.reps][0], vcs[i % kv.reps], kv.block_table,
                 kv.kv_lens, out, 128 ** -0.5, cfg)
torch.cuda.synchronize()
print(which, cfg)
