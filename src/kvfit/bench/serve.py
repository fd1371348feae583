"""``kvfit bench serve``: a bounded load generator for the OpenAI-compatible server.

A fixed number of requests (random token-id prompts of ``--input-len`` tokens, ``--output-len``
tokens each with ``ignore_eos``, so lengths are fixed and runs comparable) is sent by at most
``--max-concurrency`` streaming clients over loopback; the run stops by itself. Without
``--base-url`` it starts a server in-process on a free port with the engine flags given.

Metrics follow vLLM's ``benchmark_serving`` definitions: TTFT = send → first streamed token;
ITL = gap between consecutive streamed chunks; TPOT = (E2E − TTFT) / (output tokens − 1) per
request; E2EL = send → last chunk; throughput = totals / wall time of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default=None,
                        help="server to load, e.g. http://127.0.0.1:8000 (default: start one "
                             "in-process on a free loopback port with the engine flags below)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the run")
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="most requests in flight at once (streaming clients)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64,
                        help="generated tokens per request (ignore_eos)")
    parser.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 10000),
                        metavar=("LO", "HI"), help="prompt token ids are drawn from [LO, HI)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name sent in requests (default: the server's first model)")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the prompt sampler")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the one uncounted warm-up request")
    parser.add_argument("--result-json", default=None, help="also write the results here")
    from kvfit.config import add_engine_args

    add_engine_args(parser)
    return parser


async def _one(http, model: str, prompt: list[int], output_len: int) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = ev["error"]["message"]
                    return res
                if ev.get("usage"):
                    res.output_len = ev["usage"]["completion_tokens"]
                if not ev.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = (last or time.perf_counter()) - t0
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(base_url: str, model: Optional[str], num_prompts: int,
                        max_concurrency: int, input_len: int, output_len: int,
                        id_range=(1000, 10000), seed: int = 0, warmup: bool = True) -> dict:
    """Run the load and return the summary dict (what ``format_table`` prints)."""
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(*id_range) for _ in range(input_len)] for _ in range(num_prompts)]
    limits = httpx.Limits(max_connections=max_concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
        if warmup:
            w = await _one(http, model, prompts[0][: max(1, min(input_len, 16))], 2)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(max_concurrency)

        async def limited(p):
            async with sem:
                return await _one(http, model, p, output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[limited(p) for p in prompts])
        duration = time.perf_counter() - t0
    return summarize(results, duration, model, max_concurrency)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, max(0, int(round(0.99 * (len(s) - 1)))))]
    return {"mean": statistics.fmean(s) * 1e3, "median": statistics.median(s) * 1e3,
            "p99": p99 * 1e3}


def summarize(results: list[RequestResult], duration: float, model: str,
              max_concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "model": model, "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": max_concurrency, "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.e2e for r in ok]),
    }


def format_table(s: dict) -> str:
    rows = [("Successful requests:", s["successful_requests"]),
            ("Failed requests:", s["failed_requests"]),
            ("Maximum request concurrency:", s["max_concurrency"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:=^50}".format(s=" Serving Benchmark Result ")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:-^50}".format(s=title))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
            lines.append(f"{label:<40}{s[key][stat]:<10.2f}")
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = add_bench_serve_args(argparse.ArgumentParser(
        prog="kvfit bench serve", description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    lo, hi = args.token_id_range
    if not 0 <= lo < hi:
        parser.error("--token-id-range needs 0 <= LO < HI")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    server = None
    base_url = args.base_url
    if base_url is None:
        from kvfit.config import config_from_args
        from kvfit.engine.llm_engine import LLMEngine
        from kvfit.server.launch import BackgroundServer

        config = config_from_args(args)
        name = args.served_model_name or config.model
        print(f"starting an in-process server for {config.model} ...", flush=True)
        server = BackgroundServer(lambda: LLMEngine(config), name).start()
        base_url = server.base_url
    try:
        summary = asyncio.run(run_benchmark(
            base_url, args.served_model_name, args.num_prompts, args.max_concurrency,
            args.input_len, args.output_len, (lo, hi), args.bench_seed, not args.no_warmup))
        if server is not None:
            stats = server.engine_loop.stats() or {}
            summary["server"] = {k: stats.get(k) for k in ("kv_dtype", "pages_total",
                                                             "page_size", "num_preemptions")}
    finally:
        if server is not None:
            server.stop()
    summary["config"] = {k: getattr(args, k) for k in ("num_prompts", "max_concurrency",
                                                        "input_len", "output_len")}
    print(format_table(summary))
    if "server" in summary:
        print("server: " + ", ".join(f"{k}={v}" for k, v in summary["server"].items()))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


if __name__ == "__main__":  # python -m kvfit.bench.serve
    import sys

    sys.exit(main(sys.argv[1:]))
