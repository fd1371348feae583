"""nano-vllm's bench.py workload, offline, on the engine (until ``kvfit bench throughput``):
256 requests, prompts of randint(100, 1024) random token ids (< 10000), outputs of
randint(100, 1024) tokens with ignore_eos, Python ``random.seed(0)`` as nano-vllm draws them.
Prints output tok/s = sum(max_tokens) / wall time of one ``generate`` after a warm-up on a
slice of the workload (Triton compiles kernel variants on first use: an unwarmed first pass
measured 26% low on the H200). The prefix cache is reset before each timed pass: passes repeat
the same prompts, which would otherwise be cached (before 2026-12-02 they were, so the second
and later passes of one process skipped most of their prefill).

Usage: python3 nano_vllm_workload.py [--kv-dtype fp8] [--temperature 0.6] [engine flags ...]
"""

import argparse
import random
import time

from kvfit.bench.configs import config_path
from kvfit.config import add_engine_args, config_from_args
from kvfit.llm import LLM
from kvfit.sampling_params import SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--temperature", type=float, default=0.6)
p.add_argument("--num-seqs", type=int, default=256)
p.add_argument("--passes", default="", help="timed passes 'T:on|off,...' (default: one pass "
               "at --temperature with the engine's async_scheduling)")
add_engine_args(p)
p.set_defaults(model=config_path("qwen3-1.7b"), load_format="dummy")
args = p.parse_args()
cfg = config_from_args(args)

random.seed(0)
prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
           for _ in range(args.num_seqs)]
sps = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                      max_tokens=random.randint(100, 1024)) for _ in range(args.num_seqs)]
llm = LLM(**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
eng = llm.engine
# warm-up: a slice of the workload (every prefill/decode kernel variant it uses is compiled
# before timing; Triton compiles on first use)
llm.generate(prompts[:48], [SamplingParams(temperature=args.temperature, ignore_eos=True,
                                           max_tokens=24)] * 48, use_tqdm=False)
passes = [(args.temperature, eng.overlap)]
if args.passes:  # "T:on|off,...": several timed passes in this process (same engine)
    passes = [(float(a), b == "on") for a, b in (x.split(":") for x in args.passes.split(","))]
out = sum(sp.max_tokens for sp in sps)
for temp, overlap in passes:
    eng.overlap = overlap  # safe between generate calls: no step is in flight
    run_sps = [SamplingParams(temperature=temp, ignore_eos=True, max_tokens=sp.max_tokens)
               for sp in sps]
    llm.reset_prefix_cache()  # every pass prefills its prompts (passes repeat them)
    t = time.perf_counter()
    llm.generate(prompts, run_sps, use_tqdm=False)
    t = time.perf_counter() - t
    print(f"nano-vllm workload: kv {eng.runner.kv_format.name}, T={temp}, async {overlap}, "
          f"graphs to {eng.config.resolved_cuda_graph_max_bs}, chunk "
          f"{eng.config.max_num_batched_tokens}: {out} tokens in {t:.2f} s = "
          f"{out / t:,.0f} output tok/s, preemptions {eng.scheduler.num_preemptions}",
          flush=True)
