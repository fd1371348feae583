"""The ``kvfit`` command: generate, plan, serve, bench {quality, seed, kernels, serve, throughput,
latency, prefix}.

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
    "serve": ("kvfit.bench.serve", "load generator for kvfit serve (a running one, or its own)"),
    "throughput": ("kvfit.bench.throughput", "offline throughput and its roofline fraction"),
    "latency": ("kvfit.bench.latency", "end-to-end latency of one batch (vLLM's bench latency), "
                                       "decode rate and roofline fraction"),
    "prefix": ("kvfit.bench.prefix", "prefix caching on vs off per KV dtype: TTFT, throughput, "
                                     "hit rate, prefixes cached"),
}
DEFAULT_MAX_TOKENS = 128


def _fail(message: str) -> int:
    """One ``kvfit: error:`` line on stderr; exit status 1 (argparse's own usage errors are 2)."""
    print(f"kvfit: error: {message}", file=sys.stderr)
    return 1


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (looked up per record, so redirection applies).
    Warnings and errors of kvfit's loggers print as ``kvfit: warning: ...`` lines."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING and record.name.split(".")[0] == "kvfit":
            return f"kvfit: {record.levelname.lower()}: {record.getMessage()}"
        return super().format(record)


def _setup_logging() -> None:
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        root.addHandler(_StderrHandler())
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def _generate(argv: list[str]) -> int:
    from kvfit.config import add_engine_args, config_from_args

    p = argparse.ArgumentParser(prog="kvfit generate", description="generate text offline")
    p.add_argument("prompt_pos", nargs="*", metavar="PROMPT",
                   help="the prompt (several: one generation each, with a progress bar)")
    p.add_argument("--prompt", "-p", action="append", default=[],
                   help="a prompt (same as the positional; may repeat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate (default: {DEFAULT_MAX_TOKENS}, capped to what "
                        f"--max-model-len leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    args = p.parse_args(argv)
    prompts = list(args.prompt_pos) + list(args.prompt)
    if not prompts:
        return _fail("give a prompt: kvfit generate \"...\" (or --prompt \"...\")")
    for i, text in enumerate(prompts):
        if not text.strip():
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            return _fail(f"{which} is empty; give the text to continue, e.g. "
                         f"kvfit generate \"Why is the sky blue?\"")
    from kvfit.errors import RequestRejected
    from kvfit.sampling_params import SamplingParams

    try:  # parameters first: cheap, and nothing is loaded yet
        sp = SamplingParams(max_tokens=(DEFAULT_MAX_TOKENS if args.max_tokens is None
                                        else args.max_tokens),
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
        sp.validate()
    except RequestRejected as e:
        return _fail(str(e))
    try:  # never more requests at once than prompts: one prompt decodes one token per step,
        # so --decode-gemv auto runs its fused GEMV and only batch 1 is captured as a graph
        cfg = config_from_args(args, max_num_seqs=min(args.max_num_seqs, len(prompts)))
    except ValueError as e:
        return _fail(str(e))
    from kvfit.cli_generate import run_generate

    return run_generate(cfg, prompts, sp, chat=args.chat, max_tokens_given=args.max_tokens
                        is not None)


# EngineConfig fields that do not change what ``kvfit plan`` prices
_NOT_PLANNED = ("tokenizer", "kv_scales", "memory_ratio", "cpu_kv_space_gib", "num_pages",
                "num_tokens", "enforce_eager", "cuda_graph_max_bs", "cuda_graph_max_prefill_tokens",
                "async_scheduling", "load_format",
                "seed")


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
    rows = plan_capacity(cfg, mem, args.kv_dtype, plan_device(args.device),
                         skip_unsupported=args.kv_dtype == list(PLAN_DTYPES))
    print(format_plan(mem, rows))
    left = [d for d in args.kv_dtype if d not in {r.kv_dtype for r in rows}]
    if left:
        print(f"\nLeft out: {', '.join(left)} (this model's pool does not store them; "
              f"--kv-dtype {left[0]} says why)")
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


def _version() -> str:
    from kvfit import __version__

    return f"kvfit {__version__}"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: kvfit {generate,plan,serve,bench} [options]   (kvfit --version)\n"
              "  generate  generate text offline (default model: smollm2-135m)\n"
              "  plan      KV capacity per KV dtype for a model and memory size\n"
              "  serve     OpenAI-compatible HTTP server\n"
              "  bench     benchmarks: quality, seed, kernels, serve, throughput, latency, prefix", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"kvfit: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    _setup_logging()
    from kvfit.errors import (KVBudgetError, ModelInputError, ModelNotFoundError,
                              RequestRejected, UnsupportedCombinationError)

    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ModelNotFoundError, ModelInputError, UnsupportedCombinationError, KVBudgetError,
            RequestRejected) as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
