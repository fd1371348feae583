"""Launch the MLA decode kernel a few times for ncu (DeepSeek-V2-Lite heads, the engine's
launch choice for the point). Usage: ncu ... python3 ncu_mla.py KV_DTYPE [BATCH CONTEXT PAGE]
(default: 4 x 32k, pages of 32 for fp8 and 16 for 16-bit latents); a fifth argument picks a
swapped-kernel variant as mla_sweep.py names it (KIND:block_n:warps:stages)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../src"))
from kvfit.bench.kernels_mla import LatentSet  # noqa: E402
from kvfit.kernels.mla import decode_config, mla_decode  # noqa: E402

kvd = sys.argv[1]
b, ctx = (int(x) for x in sys.argv[2:4]) if len(sys.argv) > 3 else (4, 32768)
page = int(sys.argv[4]) if len(sys.argv) > 4 else (32 if kvd.startswith("fp8") else 16)
heads = 16
ls = LatentSet(512, 64, kvd, b, ctx, page, "cuda")
if len(sys.argv) > 5:
    kind, bn, w, st = sys.argv[5].split(":")
    cfg = decode_config(b, heads, 512, ctx, ls.dtype, torch.bfloat16, block_n=int(bn),
                        num_warps=int(w), num_stages=int(st), swap=True, qfp8="q" in kind,
                        prefetch="p" in kind, hoist=max(1, 1024 // int(bn)) if "h" in kind else 0)
else:
    cfg = decode_config(b, heads, 512, ctx, ls.dtype, torch.bfloat16)
q = torch.randn(b, heads, 576, device="cuda", dtype=torch.bfloat16)
out = torch.empty(b, heads, 512, device="cuda", dtype=torch.bfloat16)
cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
for i in range(4):
    mla_decode(q, ls.caches[i % ls.reps], ls.block_table, cu, ls.kv_lens, out, 512, 0.1, cfg)
torch.cuda.synchronize()
print(kvd, b, ctx, page, cfg, f"{ls.bytes / 1e6:.0f} MB of latents")
