"""Count the GPU kernels of one batch-1 decode step of the Qwen3-1.7B shape (random weights,
triton backend, eager) and their total GPU time: what bounds batch-1 decode besides bytes."""

import collections
import sys

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.bench.configs import config_path
from kvfit.config import make_config
from kvfit.engine.runner import ModelRunner

cfg = make_config(model=config_path("qwen3-1.7b"), load_format="dummy",
                  kv_dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16", device="cuda",
                  attention_backend="triton", num_tokens=4096, max_model_len=2048,
                  enforce_eager=True)
r = ModelRunner(cfg)
meta = build_metadata([1], [1024], [list(range(64))], 16, r.device)
ids = torch.tensor([5], device="cuda")
pos = torch.tensor([1023], device="cuda")
with torch.inference_mode():
    for _ in range(3):
        r.backend.prepare(meta)
        r.model.compute_logits(r.model(ids, pos, r.ctx)).argmax(-1)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r.backend.prepare(meta)
        r.model.compute_logits(r.model(ids, pos, r.ctx)).argmax(-1)
        torch.cuda.synchronize()
kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
tot = sum(e.device_time for e in kern)
by = collections.Counter()
tm = collections.Counter()
for e in kern:
    by[e.name[:60]] += 1
    tm[e.name[:60]] += e.device_time
print(f"kernels per decode step: {len(kern)}, GPU time {tot:.0f} us")
for n, c in by.most_common(14):
    print(f"  {c:5d} x {tm[n] / c:6.1f} us  {n}")
