"""``kvfit bench latency``: the end-to-end latency of one batch through the whole engine (vLLM's
``benchmark_latency``), and how far its decode is from the roofline.

Each iteration sends ``--batch-size`` requests of ``--input-len`` random prompt tokens to
``LLM.generate`` and waits for ``--output-len`` tokens each (``ignore_eos``, temperature 1.0 and
top-p 1.0 by default, as vLLM's); the latency is that call's wall time: admission, prefill, every
decode step with the sampler, detokenization and the outputs. Unlike vLLM's, every iteration
draws fresh prompts (seeded), so no iteration reuses the last one's prefix cache; ``--num-iters-
warmup`` uncounted iterations first (Triton compiles, graph capture, allocator growth). The
engine is built for at most ``--batch-size`` requests at once (``max_num_seqs`` capped, as
``kvfit generate`` caps it at its prompt count): at batch 1 that is the fused-GEMV decode path
(``--decode-gemv auto``), 630-642 tok/s on the H200 for Qwen3-1.7B fp8 at 1k against 544 with
the batching engine's cuBLAS path (docs/benchmarks.md).

Besides vLLM's latency percentiles it reports, per iteration, the time to first token (the
slowest request's, from its ``metrics.first_token_time``), the decode rate after it
(``batch x (output-len - 1)`` tokens over the time from the last first token to the end), and
with a CUDA device the roofline: ``throughput.roofline`` over the steps the engine actually
ran (weights + KV bytes over the measured copy bandwidth, FLOPs over the measured matmul rate).
The decode fraction divides the roofline time of the decode-only steps by the decode time, so
at batch 1 it is what ``kvfit bench seed``'s batch-1 column measures for the model alone, here
with the engine's scheduler, sampler and detokenizer in the loop.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Optional

from kvfit.bench.step_record import StepRecord, StepRecorder
from kvfit.bench.throughput import measure_ceilings, model_costs, roofline, sync_engine

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: 32)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens per request, ignore_eos (default: 128)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="requests per iteration, sent together (default: 8)")
    parser.add_argument("--num-iters-warmup", type=int, default=10,
                        help="uncounted iterations first (default: 10)")
    parser.add_argument("--num-iters", type=int, default=30,
                        help="timed iterations (default: 30)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature (default: 1.0, vLLM's; 0 is greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p (default: 1.0)")
    parser.add_argument("--bench-seed", type=int, default=0, help="prompt seed (default: 0)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the copy bandwidth and matmul rate")
    parser.add_argument("--output-json", default=None, help="write the results here")
    from kvfit.config import add_engine_args

    add_engine_args(parser)
    return parser


def percentiles(values: list[float]) -> dict[int, float]:
    """Linear-interpolated percentiles (numpy's default method) of ``values``."""
    xs = sorted(values)
    out = {}
    for p in PERCENTILES:
        pos = (len(xs) - 1) * p / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[p] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def _prompts(rng: random.Random, batch: int, input_len: int, vocab: int) -> list[list[int]]:
    hi = min(10000, vocab) - 1  # vLLM's dummy prompts: ids below 10,000
    return [[rng.randint(0, hi) for _ in range(input_len)] for _ in range(batch)]


def decode_roofline_s(record, costs: dict, ceilings: dict) -> float:
    """Roofline time of the recorded steps that only decode (no prompt tokens)."""
    rows = [i for i, (d, p) in enumerate(zip(record.decode_tokens, record.prefill_tokens))
            if d > 0 and p == 0]
    only = StepRecord(**{k: [v[i] for i in rows] for k, v in record.as_dict().items()})
    return roofline(only, costs, ceilings)["time_s"]


def _iteration(llm, params, prompts) -> dict:
    """One timed ``generate``: wall time, the slowest TTFT, the decode time after it."""
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync_engine(llm.engine)
    end = time.monotonic()
    first = [o.metrics.first_token_time for o in outs]
    n_out = [len(o.outputs[0].token_ids) for o in outs]
    return {"latency_s": end - t0, "ttft_s": max(first) - t0, "decode_s": end - max(first),
            "output_tokens": sum(n_out), "decode_tokens": sum(n - 1 for n in n_out)}


def run(args) -> dict:
    from kvfit.config import config_from_args
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    # never more requests at once than the batch (as ``kvfit generate`` caps it at its prompts):
    # each iteration sends --batch-size requests, so this changes no schedule, and at batch 1
    # --decode-gemv auto runs the fused GEMV and only batch 1 is captured as a graph
    config = config_from_args(args, max_num_seqs=min(args.max_num_seqs, args.batch_size))
    ceilings = None
    if not args.no_roofline and config.resolved_device.type == "cuda":
        ceilings = measure_ceilings(config.resolved_device)
    llm = LLM(**{k: getattr(config, k) for k in config.__dataclass_fields__})
    engine = llm.engine
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} "
                         f"exceeds the context of {engine.max_model_len} tokens: shorten them "
                         f"or raise --max-model-len")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True,
                            max_tokens=args.output_len)
    rng = random.Random(args.bench_seed)
    vocab = engine.runner.hf_config.vocab_size
    for _ in range(args.num_iters_warmup):
        llm.generate(_prompts(rng, args.batch_size, args.input_len, vocab), params,
                     use_tqdm=False)
    costs = model_costs(engine.runner) if ceilings is not None else None
    iters = []
    for _ in range(args.num_iters):
        prompts = _prompts(rng, args.batch_size, args.input_len, vocab)
        rec = StepRecorder().attach(engine)
        try:
            it = _iteration(llm, params, prompts)
        finally:
            rec.detach()
        it["num_steps"] = rec.record.num_steps
        if costs is not None:
            it["roofline_s"] = roofline(rec.record, costs, ceilings)["time_s"]
            it["decode_roofline_s"] = decode_roofline_s(rec.record, costs, ceilings)
        iters.append(it)
    lat = [it["latency_s"] for it in iters]
    res = {"model": config.model, "kv_dtype": engine.runner.kv_format.name,
           "device": str(engine.runner.device), "batch_size": args.batch_size,
           "input_len": args.input_len, "output_len": args.output_len,
           "temperature": args.temperature, "top_p": args.top_p,
           "avg_latency": statistics.fmean(lat), "latencies": lat,
           "percentiles": {str(p): v for p, v in percentiles(lat).items()},
           "ttft_median_s": statistics.median(it["ttft_s"] for it in iters),
           "decode_tok_s": statistics.median(it["decode_tokens"] / it["decode_s"]
                                             for it in iters if it["decode_s"] > 0)
           if args.output_len > 1 else None,
           "iterations": iters}
    if costs is not None:
        res.update(ceilings=ceilings, costs=costs,
                   roofline_fraction=statistics.median(it["roofline_s"] / it["latency_s"]
                                                       for it in iters))
        if args.output_len > 1:
            res["decode_roofline_fraction"] = statistics.median(
                it["decode_roofline_s"] / it["decode_s"] for it in iters if it["decode_s"] > 0)
    return res


def format_result(r: dict) -> str:
    lines = [f"{r['model']} ({r['kv_dtype']} KV, {r['device']}): batch {r['batch_size']}, "
             f"{r['input_len']} prompt + {r['output_len']} output tokens, temperature "
             f"{r['temperature']:g}, {len(r['latencies'])} iterations",
             f"Avg latency: {r['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in r["percentiles"].items()]
    lines.append(f"TTFT (slowest request, median): {1e3 * r['ttft_median_s']:.2f} ms")
    if r["decode_tok_s"] is not None:
        per = r["decode_tok_s"] / r["batch_size"]
        lines.append(f"decode after the first token: {r['decode_tok_s']:,.1f} tok/s "
                     f"({per:,.1f} per request, {1e3 / per:.3f} ms per step)")
    if "roofline_fraction" in r:
        c = r["ceilings"]
        tail = (f", decode {r['decode_roofline_fraction']:.1%}"
                if "decode_roofline_fraction" in r else "")
        lines.append(f"roofline (copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                     f"{c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s): achieved "
                     f"{r['roofline_fraction']:.1%} of the whole request{tail}")
    else:
        lines.append("roofline: skipped (CPU or --no-roofline)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = add_args(argparse.ArgumentParser(prog="kvfit bench latency",
                                              description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_iters_warmup < 0:
        parser.error("--num-iters-warmup must be >= 0")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    try:
        res = run(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(format_result(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":  # python -m kvfit.bench.latency
    import sys

    sys.exit(main(sys.argv[1:]))
