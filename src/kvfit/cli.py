"""The ``kvfit`` command: generate, plan, serve, bench {quality, seed, kernels, serve, prefix}.

Engine flags are generated from EngineConfig (kvfit.config.add_engine_args): one source.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional

# subcommands implemented in their own modules: name -> (module, help)
_BENCHES = {
    "quality": ("kvfit.bench.quality", "needle, greedy agreement, KL and perplexity per KV dtype"),
    "seed": ("kvfit.bench.seed", "the seed's table on a GPU: capacity, decode, prefill"),
    "kernels": ("kvfit.bench.kernels", "attention kernels vs FlashInfer on the GPU"),
    "serve": ("kvfit.bench.serve", "load generator for kvfit serve (a running one, or in-process)"),
    "prefix": ("kvfit.bench.prefix", "prefix caching on vs off per KV dtype: TTFT, throughput, "
                                     "hit rate, prefixes cached"),
}


def _generate(argv: list[str]) -> int:
    from kvfit.config import add_engine_args, config_from_args

    p = argparse.ArgumentParser(prog="kvfit generate", description="generate text offline")
    p.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="the prompt")
    p.add_argument("--prompt", "-p", help="the prompt (same as the positional)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    args = p.parse_args(argv)
    prompt = args.prompt if args.prompt is not None else args.prompt_pos
    if prompt is None:
        p.error("give a prompt: kvfit generate \"...\" (or --prompt)")
    from kvfit.errors import RequestRejected
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    except RequestRejected as e:
        p.error(str(e))
    cfg = config_from_args(args)
    llm = LLM(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    outs = (llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False) if args.chat
            else llm.generate(prompt, sp, use_tqdm=False))
    print(outs[0].outputs[0].text)
    return 0


# EngineConfig fields that do not change what ``kvfit plan`` prices
_NOT_PLANNED = ("tokenizer", "kv_scales", "memory_ratio", "cpu_kv_space_gib", "num_pages",
                "num_tokens", "enforce_eager", "cuda_graph_max_bs", "load_format", "seed")


def _plan(argv: list[str]) -> int:
    from kvfit.config import add_engine_args, config_from_args
    from kvfit.plan import PLAN_DTYPES, format_plan, parse_memory, plan_capacity, plan_device

    p = argparse.ArgumentParser(prog="kvfit plan",
                                description="KV capacity per KV dtype for a model and a KV memory "
                                            "size, from the config alone, with the backend and "
                                            "page size the engine would choose on --device")
    p.add_argument("--memory", required=True, help="KV memory, e.g. 2.9GiB")
    add_engine_args(p, skip=_NOT_PLANNED, many=("kv_dtype",),
                    defaults={"device": "cuda", "kv_dtype": list(PLAN_DTYPES)})
    args = p.parse_args(argv)
    try:
        mem = parse_memory(args.memory)
        cfg = config_from_args(args, kv_dtype="auto")
    except ValueError as e:
        p.error(str(e))
    rows = plan_capacity(cfg, mem, args.kv_dtype, plan_device(args.device))
    print(format_plan(mem, rows))
    return 0


def _serve(argv: list[str]) -> int:
    return importlib.import_module("kvfit.server.main").main(argv)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in _BENCHES:
        names = "\n".join(f"  {k:8s} {h}" for k, (_, h) in _BENCHES.items())
        print(f"usage: kvfit bench {{{','.join(_BENCHES)}}} [options]\n{names}", file=sys.stderr)
        return 2
    return importlib.import_module(_BENCHES[argv[0]][0]).main(argv[1:])


COMMANDS = {"generate": _generate, "plan": _plan, "serve": _serve, "bench": _bench}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: kvfit {generate,plan,serve,bench} [options]\n"
              "  generate  generate text offline (default model: smollm2-135m)\n"
              "  plan      KV capacity per KV dtype for a model and memory size\n"
              "  serve     OpenAI-compatible HTTP server\n"
              "  bench     benchmarks: quality, seed, kernels, serve, prefix", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvfit.errors import (KVBudgetError, ModelNotFoundError, RequestRejected,
                              UnsupportedCombinationError)

    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ModelNotFoundError, UnsupportedCombinationError, KVBudgetError, RequestRejected) as e:
        print(f"kvfit: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
