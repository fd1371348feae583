"""``kvfit bench prefix``: automatic prefix caching on vs off, per KV format, in-process.

For each ``--kv-dtypes`` entry and caching on/off one engine is built from the engine flags and
runs (after an uncounted warm-up): a TTFT probe (one request with a fresh ``--prefix-len``
prefix, then one sharing it, alone), the shared-system-prompt workload (``--num-requests`` ×
prefix + ``--suffix-len`` unique tokens, ``--output-len`` out, sent at once), the multi-turn
workload and nano-vllm's random-prompt workload (nothing shared); with caching on, a capacity
probe counts how many distinct prefixes stay cached in that pool. One table, the target ratios
(cached/uncached TTFT, on/off throughput, random-prompt slowdown) and a JSON file.

GPU target run: ``kvfit bench prefix`` (default model: the shipped Qwen3-1.7B config,
kvfit/bench/configs/qwen3-1.7b.json, random weights). A config.json model gets
``--load-format dummy`` by itself. CPU smoke: ``--device cpu`` and tiny sizes (see
tests/test_bench_prefix.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
from typing import Optional

from kvfit.bench import prefix_workloads as wl

log = logging.getLogger("kvfit")


def build_parser() -> argparse.ArgumentParser:
    from kvfit.bench.configs import config_path

    p = argparse.ArgumentParser(prog="kvfit bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=config_path("qwen3-1.7b"),
                   help="config.json (random weights) or model directory (default: the shipped "
                        "Qwen3-1.7B config)")
    p.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "fp8_e4m3"],
                   help="KV formats to compare (one engine each, caching on and off)")
    p.add_argument("--caching", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--workloads", nargs="+", default=["shared", "multi-turn", "random"],
                   choices=["shared", "multi-turn", "random"])
    p.add_argument("--num-requests", type=int, default=64, help="shared-prefix requests")
    p.add_argument("--prefix-len", type=int, default=4096, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="unique tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens out per request")
    p.add_argument("--num-chats", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=256,
                   help="multi-turn: new user tokens per turn (answers are --output-len)")
    p.add_argument("--random-requests", type=int, default=256, help="random workload requests")
    p.add_argument("--random-min-len", type=int, default=100)
    p.add_argument("--random-max-len", type=int, default=1024,
                   help="random workload: input and output lengths uniform in [min, max]")
    p.add_argument("--probe-repeats", type=int, default=3, help="TTFT probe pairs (median)")
    p.add_argument("--capacity-max", type=int, default=4096,
                   help="most distinct prefixes the capacity probe sends (0 = skip it)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--result-json", default="bench_prefix.json", help="where to write results")
    from kvfit.config import add_engine_args

    add_engine_args(p, skip=("model", "kv_dtype", "enable_prefix_caching"))
    return p


def _check_lengths(args, max_model_len: int) -> None:
    need = {"shared": args.prefix_len + args.suffix_len + args.output_len,
            "multi-turn": args.turns * (args.turn_len + args.output_len),
            "random": 2 * args.random_max_len}
    for w in args.workloads:
        if need[w] > max_model_len:
            raise SystemExit(f"kvfit bench prefix: the {w} workload needs {need[w]} tokens per "
                             f"request, the engine holds {max_model_len}: raise --max-model-len "
                             f"or shrink the workload")


def _free(engine) -> None:
    del engine
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_one(args, kv_dtype: str, caching: bool) -> dict:
    """Build one engine, run every asked workload on it, return its results (engine freed)."""
    from kvfit.config import config_from_args
    from kvfit.engine.llm_engine import LLMEngine

    over = {"load_format": "dummy"} if (args.model.endswith(".json")
                                        and args.load_format == "auto") else {}
    engine = LLMEngine(config_from_args(args, kv_dtype=kv_dtype, enable_prefix_caching=caching,
                                        **over))
    _check_lengths(args, engine.max_model_len)
    seed = args.bench_seed
    # warm-up (uncounted): a prefill, then an extend over a cached prefix, then decode
    warm = min(64, engine.max_model_len // 4)
    wl.ttft_probe(engine, warm, 8, seed + 99)
    row = {"kv_dtype": engine.runner.kv_format.name, "caching": "on" if caching else "off",
           "pages_total": engine.allocator.num_pages, "page_size": engine.config.page_size,
           "kv_gib": engine.runner.pool.allocated_bytes() / 2**30, "workloads": {}}
    probes = [wl.ttft_probe(engine, args.prefix_len, args.suffix_len, seed + 1000 + i)
              for i in range(args.probe_repeats)]
    row["probe"] = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    runs = {"shared": lambda: wl.shared_prefix(engine, args.num_requests, args.prefix_len,
                                               args.suffix_len, args.output_len, seed + 1),
            "multi-turn": lambda: wl.multi_turn(engine, args.num_chats, args.turns,
                                                args.turn_len, args.output_len, seed + 2),
            "random": lambda: wl.random_prompts(engine, args.random_requests,
                                                args.random_min_len, args.random_max_len,
                                                seed + 3)}
    for w in args.workloads:
        row["workloads"][w] = runs[w]().summary()
    if caching and args.capacity_max > 0:
        row["capacity"] = wl.capacity_probe(engine, args.prefix_len, seed + 4, args.capacity_max)
    stats = engine.stats()
    row["prefix_cache_queries"] = stats["prefix_cache_queries"]
    row["prefix_cache_hits"] = stats["prefix_cache_hits"]
    _free(engine)
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """The issue's targets per KV format, where both caching modes ran."""
    out = []
    by = {(r["kv_dtype"], r["caching"]): r for r in rows}
    for fmt in dict.fromkeys(r["kv_dtype"] for r in rows):
        on, off = by.get((fmt, "on")), by.get((fmt, "off"))
        if on is None:
            continue
        r = {"kv_dtype": fmt, "probe_ttft_cached_over_uncached":
             on["probe"]["cached_ttft_ms"] / max(on["probe"]["uncached_ttft_ms"], 1e-9)}
        if off is not None:
            for w in on["workloads"]:
                a, b = on["workloads"][w], off["workloads"].get(w)
                if b:
                    r[f"{w}_throughput_on_over_off"] = a["total_tok_s"] / max(b["total_tok_s"],
                                                                              1e-9)
                    r[f"{w}_ttft_median_on_over_off"] = (a["ttft_median_ms"]
                                                         / max(b["ttft_median_ms"], 1e-9))
        if on.get("capacity"):
            r["prefixes_cached"] = on["capacity"]["prefixes_cached"]
        out.append(r)
    return out


def format_table(rows: list[dict], summary: list[dict], prefix_len: int) -> str:
    head = (f"{'kv_dtype':9s} {'cache':5s} {'workload':13s} {'reqs':>5s} {'TTFT med ms':>11s} "
            f"{'TTFT p99 ms':>11s} {'out tok/s':>10s} {'tot tok/s':>10s} {'hit rate':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r["probe"]
        lines.append(f"{r['kv_dtype']:9s} {r['caching']:5s} {'probe uncached':13s} {1:5d} "
                     f"{p['uncached_ttft_ms']:11.1f} {'':>11s} {'':>10s} {'':>10s} {'':>8s}")
        lines.append(f"{'':9s} {'':5s} {'probe cached':13s} {1:5d} {p['cached_ttft_ms']:11.1f} "
                     f"{'':>11s} {'':>10s} {'':>10s} "
                     f"{p['cached_tokens'] / max(prefix_len, 1):8.1%}")
        for w, s in r["workloads"].items():
            lines.append(f"{'':9s} {'':5s} {w:13s} {s['requests']:5d} {s['ttft_median_ms']:11.1f} "
                         f"{s['ttft_p99_ms']:11.1f} {s['output_tok_s']:10.1f} "
                         f"{s['total_tok_s']:10.1f} {s['hit_rate']:8.1%}")
        if r.get("capacity"):
            c = r["capacity"]
            lines.append(f"{'':9s} {'':5s} distinct {prefix_len}-token prefixes cached: "
                         f"{c['prefixes_cached']} of {c['prefixes_sent']} sent (pool "
                         f"{c['pages_total']} pages x {r['page_size']}, {r['kv_gib']:.2f} GiB; "
                         f"bound {c['bound']})")
    lines.append("")
    lines.append("targets: probe cached/uncached TTFT <= 0.10; shared throughput on/off >= 3.0; "
                 "random throughput on/off >= 0.98")
    for s in summary:
        parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()
                 if k != "kv_dtype"]
        lines.append(f"{s['kv_dtype']}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = []
    for fmt in args.kv_dtypes:
        for mode in args.caching:
            print(f"running kv_dtype={fmt} prefix caching {mode} ...", file=sys.stderr, flush=True)
            rows.append(run_one(args, fmt, mode == "on"))
    summary = ratios(rows)
    print(format_table(rows, summary, args.prefix_len))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": rows,
                       "ratios": summary}, f, indent=2, default=str)
        print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
