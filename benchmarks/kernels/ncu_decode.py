"""Launch one decode variant a few times for ncu.
Usage: ncu ... python3 ncu_decode.py {bf16|fp8_hnd|fp8_vt} [layout batch context page]
(default: qwen3-1.7b heads, batch 32 x 16k, pages of 16; the engine's launch for that variant)"""

import sys

import torch

from kvfit.bench.kernels_common import LAYOUTS, KVSet
from kvfit.kernels.decode import choose_config, paged_decode

which = sys.argv[1]
layout = sys.argv[2] if len(sys.argv) > 2 else "qwen3-1.7b"
b, ctx, page = (int(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (32, 16384, 16)
hq, hkv, d = LAYOUTS[layout]
kvd = "bfloat16" if which == "bf16" else "fp8_e4m3"
kv = KVSet(hkv, d, kvd, b, ctx, page, "cuda")
vt = which == "fp8_vt"
cfg = choose_config(b, hkv, hq // hkv, d, ctx, kv.dtype, torch.bfloat16, v_t=vt)
vcs = [c[1].transpose(2, 3).contiguous() if vt else c[1] for c in kv.caches]
q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for i in range(6):
    paged_decode(q, kv.caches[i % kv.reps][0], vcs[i % kv.reps], kv.block_table,
                 kv.kv_lens, out, d ** -0.5, cfg)
torch.cuda.synchronize()
print(which, layout, b, ctx, page, cfg, f"{kv.bytes / 1e6:.0f} MB")
