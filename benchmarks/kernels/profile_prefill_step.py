"""Where a whole-model prefill step spends its time, per attention backend and KV dtype: the
engine's runner on the Qwen3-1.7B shape (random weights), one 2048-token prompt, wall time per
step and the top CUDA kernels from torch.profiler. Usage: python3 profile_prefill_step.py
[kv_dtype:backend ...]  (default: bfloat16:fi bfloat16:triton fp8_e4m3:triton)"""

import sys
import time

import torch

from kvfit.bench.seed import DEFAULT_CONFIG
from kvfit.bench.seed_points import fill_pool_of, prefill_point
from kvfit.config import make_config
from kvfit.engine.runner import ModelRunner

N = 2048
for spec in sys.argv[1:] or ["bfloat16:fi", "bfloat16:triton", "fp8_e4m3:triton"]:
    kvd, backend = spec.split(":")
    cfg = make_config(model=DEFAULT_CONFIG, load_format="dummy", kv_dtype=kvd, device="cuda",
                      attention_backend=backend, num_tokens=4 * N, max_model_len=2 * N,
                      max_num_seqs=4, max_num_batched_tokens=N, enforce_eager=True)
    runner = ModelRunner(cfg)
    fill_pool_of(runner)
    tok_s = prefill_point(runner, N)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prefill_point(runner, N)
        wall = time.perf_counter() - t0
    print(f"== {kvd} on {runner.backend_name}, page {runner.pool.page_size}: {tok_s:,.0f} tok/s "
          f"({N / tok_s * 1e3:.2f} ms/step); profiled 4 steps in {wall * 1e3:.1f} ms", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))
    del runner
    torch.cuda.empty_cache()
