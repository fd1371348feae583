"""``kvfit bench throughput``: offline throughput of the engine, and how far it is from the
workload's roofline.

Workload: nano-vllm's ``bench.py`` by default (256 requests, prompt lengths uniform in
[100, 1024], output lengths uniform in [100, 1024], ``ignore_eos``, temperature 0.6, token ids
uniform in [0, 10000], Python's ``random`` seeded with 0, drawn in nano-vllm's order), or vLLM's
``benchmark_throughput`` random dataset: ``--input-len`` / ``--output-len`` fix the lengths,
``--num-prompts`` the count. An uncounted warm-up pass over ``--warmup-prompts`` other prompts
of the same shape, as many as the timed run by default, at most 32 output tokens each (Triton
compiles prefill/store variants on first use and the caching allocators grow: on the H200 a
cold first pass measured 26% low, and a pass after a warm-up of 32 short requests still 12%
below a second pass; other prompts, so nothing timed is prefix-cached), then one timed
``generate``.

Roofline: the engine's steps are recorded on the host (``step_record``: decode tokens, prefill
tokens, KV entries read per step). A step cannot take less than
``max((weight bytes + KV bytes read) / copy bandwidth, FLOPs / matmul rate)`` with
FLOPs = 2 x linear parameters x tokens + 2 x LM-head parameters x sampled rows + 4 x q-heads x
head_dim x layers x (causal prefill pairs + decode KV length); the workload's roofline time is
the sum over the steps the engine actually ran (so preemption recompute counts as work), and the
achieved fraction is that over the measured time. Both ceilings are measured at start on the
GPU, before the engine takes its memory (a 2 GiB device-to-device copy, read + write bytes; an
8192^3 bf16 matmul); on the CPU the roofline is skipped. Weight bytes count every parameter once
(as ``kvfit bench seed`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import Optional

from kvfit.bench.weight_reads import bytes_read, weight_reads


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-prompts", type=int, default=256, help="requests (default: 256)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens per request (default: uniform in [100, 1024])")
    parser.add_argument("--output-len", type=int, default=None,
                        help="output tokens per request, ignore_eos (default: uniform in "
                             "[100, 1024])")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="sampling temperature (default: 0.6, nano-vllm's)")
    parser.add_argument("--token-id-range", type=int, nargs=2, default=(0, 10000),
                        metavar=("LO", "HI"), help="prompt token ids uniform in [LO, HI]")
    parser.add_argument("--bench-seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--warmup-prompts", type=int, default=None,
                        help="uncounted warm-up requests of the same shape, other token ids, at "
                             "most 32 output tokens each (default: --num-prompts, so the "
                             "warm-up admits, prefills and decodes batches as large as the "
                             "timed run's)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the copy bandwidth and matmul rate")
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write a per-step roofline plot (matplotlib) here")
    from kvfit.config import add_engine_args

    add_engine_args(parser)
    return parser


def make_workload(num_prompts: int, input_len: Optional[int], output_len: Optional[int],
                  id_range=(0, 10000), seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths): nano-vllm's draws for the lengths left None."""
    rng = random.Random(seed)
    lo, hi = id_range
    prompts = [[rng.randint(lo, hi) for _ in range(input_len or rng.randint(100, 1024))]
               for _ in range(num_prompts)]
    outs = [output_len or rng.randint(100, 1024) for _ in range(num_prompts)]
    return prompts, outs


def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s) on a CUDA device."""
    import torch
    import triton

    from kvfit.bench.kernels_common import copy_bandwidth

    bw = copy_bandwidth(device)
    n = 8192
    ab = [torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ms = triton.testing.do_bench(lambda: ab[0] @ ab[1], warmup=25, rep=200,
                                 return_mode="median")
    ab.clear()
    torch.cuda.empty_cache()  # before the engine sizes its KV pool from the free memory
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * n ** 3 / (ms * 1e-3)}


def model_costs(runner) -> dict:
    """Per-token prices of ``runner``'s model: bytes, linear parameters, attention width."""
    from kvfit.kvcache.spec import spec_kv_bytes_per_token

    c = runner.hf_config
    linear = sum(p.numel() for name, p in runner.model.named_parameters()
                 if p.dim() == 2 and "embed" not in name and "lm_head" not in name)
    hd = runner.layers[0].head_dim
    return {"weight_bytes": runner.weight_bytes,
            "weight_reads": dataclasses.asdict(weight_reads(runner.model)),
            "kv_bytes_per_token": spec_kv_bytes_per_token(runner.layers, runner.kv_format),
            "linear_params": linear, "lm_head_params": c.vocab_size * c.hidden_size,
            "attn_flops_per_pair": 4 * c.num_attention_heads * hd * c.num_hidden_layers}


def roofline(record, costs: dict, ceilings: dict) -> dict:
    """Per-step lower bounds (seconds) and their sum over the recorded steps."""
    bw, rate = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    mem, comp = [], []
    for dec, pre, kv, dkv, attn, smp in zip(record.decode_tokens, record.prefill_tokens,
                                            record.kv_tokens, record.decode_kv,
                                            record.prefill_attn, record.sampled):
        weights = (bytes_read(costs["weight_reads"], dec + pre) if "weight_reads" in costs
                   else costs["weight_bytes"])
        mem.append((weights + kv * costs["kv_bytes_per_token"]) / bw)
        flops = (2 * costs["linear_params"] * (dec + pre) + 2 * costs["lm_head_params"] * smp
                 + costs["attn_flops_per_pair"] * (attn + dkv))
        comp.append(flops / rate)
    bound = [max(m, c) for m, c in zip(mem, comp)]
    return {"step_memory_s": mem, "step_compute_s": comp, "time_s": sum(bound),
            "memory_bound_steps": sum(m >= c for m, c in zip(mem, comp))}


def run(args) -> dict:
    from kvfit.bench.step_record import StepRecorder
    from kvfit.config import config_from_args
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    config = config_from_args(args)
    prompts, out_lens = make_workload(args.num_prompts, args.input_len, args.output_len,
                                      tuple(args.token_id_range), args.bench_seed)
    ceilings = None
    if not args.no_roofline and config.resolved_device.type == "cuda":
        ceilings = measure_ceilings(config.resolved_device)
    llm = LLM(**{k: getattr(config, k) for k in config.__dataclass_fields__})
    engine = llm.engine
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
              for n in out_lens]
    n_warm = args.num_prompts if args.warmup_prompts is None else args.warmup_prompts
    warm, _ = make_workload(max(1, n_warm), args.input_len, args.output_len,
                            tuple(args.token_id_range), args.bench_seed + 1)
    llm.generate(warm, SamplingParams(temperature=args.temperature, max_tokens=32,
                                      ignore_eos=True), use_tqdm=False)
    sync_engine(engine)
    rec = StepRecorder().attach(engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync_engine(engine)
    elapsed = time.perf_counter() - t0
    rec.detach()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    res = {"model": config.model, "kv_dtype": engine.runner.kv_format.name,
           "device": str(engine.runner.device), "num_prompts": len(prompts),
           "input_tokens": n_in, "output_tokens": n_out, "elapsed_s": elapsed,
           "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed,
           "num_steps": rec.record.num_steps,
           "num_preemptions": engine.scheduler.num_preemptions,
           "workload": {"input_len": args.input_len, "output_len": args.output_len,
                        "temperature": args.temperature, "seed": args.bench_seed},
           "steps": rec.record.as_dict()}
    if ceilings is not None:
        costs = model_costs(engine.runner)
        roof = roofline(rec.record, costs, ceilings)
        res.update(ceilings=ceilings, costs=costs, roofline_time_s=roof["time_s"],
                   roofline_output_tok_s=n_out / roof["time_s"],
                   roofline_fraction=roof["time_s"] / elapsed,
                   memory_bound_steps=roof["memory_bound_steps"])
        res["steps"].update(memory_s=roof["step_memory_s"], compute_s=roof["step_compute_s"])
    return res


def sync_engine(engine) -> None:
    """Wait for ``engine``'s device (a no-op on the CPU): timings end after the GPU's work."""
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.runner.device)


def format_result(r: dict) -> str:
    lines = [f"{r['model']} ({r['kv_dtype']} KV, {r['device']}): {r['num_prompts']} requests, "
             f"{r['input_tokens']:,} prompt + {r['output_tokens']:,} output tokens in "
             f"{r['elapsed_s']:.2f} s, {r['num_steps']:,} steps, "
             f"{r['num_preemptions']} preemptions",
             f"output throughput: {r['output_tok_s']:,.1f} tok/s",
             f"total throughput:  {r['total_tok_s']:,.1f} tok/s"]
    if "roofline_fraction" in r:
        c = r["ceilings"]
        lines.append(f"roofline: {r['roofline_output_tok_s']:,.1f} output tok/s "
                     f"({r['roofline_time_s']:.2f} s; copy {c['copy_bytes_per_s'] / 1e12:.2f} "
                     f"TB/s, bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; "
                     f"{r['memory_bound_steps']}/{r['num_steps']} steps memory-bound) -> "
                     f"achieved {r['roofline_fraction']:.1%}")
    else:
        lines.append("roofline: skipped (CPU or --no-roofline)")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Per-step batch composition and, with a roofline, the per-step lower bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["steps"]
    rows = 2 if "memory_s" in s else 1
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot(s["decode_tokens"], label="decode tokens", lw=0.8)
    ax.plot(s["prefill_tokens"], label="prefill tokens", lw=0.8)
    ax.set_ylabel("tokens / step")
    ax.legend(loc="upper right")
    ax.set_title(f"{r['model']} {r['kv_dtype']}: {r['output_tok_s']:,.0f} output tok/s"
                 + (f", {r['roofline_fraction']:.0%} of roofline" if rows == 2 else ""))
    if rows == 2:
        ax = axes[1][0]
        ax.plot([1e3 * x for x in s["memory_s"]], label="bytes / copy bandwidth", lw=0.8)
        ax.plot([1e3 * x for x in s["compute_s"]], label="FLOPs / matmul rate", lw=0.8)
        ax.axhline(1e3 * r["elapsed_s"] / max(1, r["num_steps"]), color="k", ls="--",
                   label="measured mean step")
        ax.set_ylabel("ms")
        ax.legend(loc="upper right")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = add_args(argparse.ArgumentParser(prog="kvfit bench throughput",
                                              description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    lo, hi = args.token_id_range
    if not 0 <= lo <= hi:
        parser.error("--token-id-range needs 0 <= LO <= HI")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    try:
        res = run(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(format_result(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":  # python -m kvfit.bench.throughput
    import sys

    sys.exit(main(sys.argv[1:]))
