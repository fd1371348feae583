"""``kvfit bench serve``: a bounded load generator for the OpenAI-compatible server.

A fixed number of requests (random token-id prompts of ``--input-len`` tokens, ``--output-len``
tokens each with ``ignore_eos``, so lengths are fixed and runs comparable) is sent by at most
``--max-concurrency`` streaming clients over loopback; the run stops by itself. Without
``--base-url`` it starts a server (``kvfit serve``: uvicorn in a child process, the engine in a
process of its own) on a free port with the engine flags given, so the load generator shares no
GIL with the server. ``--offline`` then runs the same requests through the same engine config in
this process (``max_num_seqs`` capped at ``--max-concurrency``, so both run the same batch sizes)
and prints server / offline output throughput.

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
                        help="skip the one uncounted warm-up request (a whole prompt, <= 4 "
                             "tokens out; the offline run makes the same one)")
    parser.add_argument("--result-json", default=None, help="also write the results here")
    parser.add_argument("--offline", action="store_true",
                        help="after the server run, run the same requests offline in this process "
                             "(max_num_seqs = min(--max-num-seqs, --max-concurrency)) and print "
                             "the server/offline output-throughput ratio (needs no --base-url)")
    parser.add_argument("--step-log", default=None, metavar="PREFIX",
                        help="time every engine step (kvfit.bench.step_timer) of the started "
                             "server's engine into PREFIX.server.json and of the --offline run "
                             "into PREFIX.offline.json, and print where each run's time went")
    from kvfit.config import add_engine_args

    add_engine_args(parser)
    return parser


async def _one(pool, model: str, prompt: list[int], output_len: int) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    last = None
    try:
        async with pool.stream_post("/v1/completions", body) as (status, events):
            if status != 200:
                async for _, payloads in events:
                    res.error = f"HTTP {status}: {b''.join(payloads)[:200]!r}"
                return res
            async for now, payloads in events:  # every event of one read: one arrival time
                for raw in payloads:
                    if raw == b"[DONE]":
                        continue
                    ev = json.loads(raw)
                    if "error" in ev:
                        res.error = ev["error"]["message"]
                        return res
                    if ev.get("usage"):
                        res.output_len = ev["usage"]["completion_tokens"]
                    if not ev.get("choices"):
                        continue
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
    from urllib.parse import urlsplit

    import httpx

    from kvfit.bench.sse_client import ConnectionPool

    prompts = make_prompts(num_prompts, input_len, id_range, seed)
    if model is None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
    url = urlsplit(base_url)
    pool = ConnectionPool(url.hostname, url.port or 80)
    try:
        if warmup:  # a whole prompt: compiles the prefill kernels' shapes before timing
            w = await _one(pool, model, prompts[0], min(output_len, 4))
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(max_concurrency)

        async def limited(p):
            async with sem:
                return await _one(pool, model, p, output_len)

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        results = await asyncio.gather(*[limited(p) for p in prompts])
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        pool.close()
    summary = summarize(results, duration, model, max_concurrency)
    summary["client_cpu_s"] = cpu  # the load generator's own CPU time (it must not saturate)
    return summary


def make_prompts(num_prompts: int, input_len: int, id_range=(1000, 10000),
                 seed: int = 0) -> list[list[int]]:
    """The run's prompts (the same for the server and the offline run)."""
    rng = random.Random(seed)
    return [[rng.randrange(*id_range) for _ in range(input_len)] for _ in range(num_prompts)]


def run_offline(config, prompts: list[list[int]], output_len: int, max_concurrency: int,
                step_log: Optional[str] = None) -> dict:
    """The same requests through ``LLM`` in this process, ``max_num_seqs`` capped at the
    concurrency; output/total token throughput over the wall time of ``generate`` (its steps
    timed into ``step_log`` when given)."""
    import dataclasses

    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    seqs = min(config.max_num_seqs, max_concurrency)
    llm = LLM(**{**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                 "max_num_seqs": seqs})
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=min(output_len, 4), ignore_eos=True)
        llm.generate([prompts[0]], warm, use_tqdm=False)  # the server run's warm-up
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        timer = None
        if step_log is not None:
            from kvfit.bench.step_timer import StepTimer

            timer = StepTimer().attach(llm.engine)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - t0
        if timer is not None:
            timer.dump(step_log)
    finally:
        del llm
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {"max_num_seqs": seqs, "duration_s": duration, "total_output_tokens": n_out,
            "output_throughput": n_out / duration,
            "total_token_throughput": (n_in + n_out) / duration}


def server_info(base_url: str) -> dict:
    """KV dtype, pages and preemptions from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    info: dict = {}
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "kvfit_kv_cache_info":
                info["kv_dtype"] = smp.labels.get("kv_dtype")
            elif smp.name == "kvfit_kv_pages_total":
                info["pages_total"] = int(smp.value)
            elif smp.name == "kvfit_num_preemptions_total":
                info["num_preemptions"] = int(smp.value)
    return info


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
    if "client_cpu_s" in s:
        lines.append(f"load generator CPU: {s['client_cpu_s']:.2f} s over "
                     f"{s['duration_s']:.2f} s ({s['client_cpu_s'] / s['duration_s']:.0%})")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def print_step_logs(prefix: str) -> dict:
    """Per run (server, offline): where the engine's time went over its timed run (the steps
    after the warm-up's last one)."""
    import os

    from kvfit.bench.step_timer import after_first_idle, summarize

    out = {}
    for run in ("server", "offline"):
        path = f"{prefix}.{run}.json"
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = json.load(f)["rows"]
        # the server's engine ran the warm-up request first (the offline timer starts after it)
        out[run] = s = summarize(after_first_idle(rows) if run == "server" else rows)
        print(f"engine steps ({run}): " + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))
    return out


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
    if args.offline and args.base_url is not None:
        parser.error("--offline runs the server's engine config in this process: leave out "
                     "--base-url")
    server = None
    base_url = args.base_url
    config = None
    if base_url is None:
        from kvfit.config import config_from_args
        from kvfit.server.launch import ServerProcess

        try:
            config = config_from_args(args)
        except (TypeError, ValueError) as e:
            parser.error(str(e))
        name = args.served_model_name or config.model
        print(f"starting a server for {config.model} ...", flush=True)
        factory = None
        if args.step_log is not None:  # the engine process times its steps (picklable)
            import functools

            from kvfit.bench.step_timer import timed_engine

            factory = functools.partial(timed_engine, config, args.step_log + ".server.json")
        server = ServerProcess(config, name, engine_factory=factory).start()
        base_url = server.base_url
    try:
        summary = asyncio.run(run_benchmark(
            base_url, args.served_model_name, args.num_prompts, args.max_concurrency,
            args.input_len, args.output_len, (lo, hi), args.bench_seed, not args.no_warmup))
        if server is not None:
            summary["server"] = server_info(base_url)
    finally:
        if server is not None:
            server.stop()
    summary["config"] = {k: getattr(args, k) for k in ("num_prompts", "max_concurrency",
                                                        "input_len", "output_len")}
    print(format_table(summary))
    if "server" in summary:
        print("server: " + ", ".join(f"{k}={v}" for k, v in summary["server"].items()))
    if args.offline:
        prompts = make_prompts(args.num_prompts, args.input_len, (lo, hi), args.bench_seed)
        off = run_offline(config, prompts, args.output_len, args.max_concurrency,
                          None if args.step_log is None else args.step_log + ".offline.json")
        off["server_over_offline"] = summary["output_throughput"] / off["output_throughput"]
        summary["offline"] = off
        print(f"offline (max_num_seqs={off['max_num_seqs']}): "
              f"{off['output_throughput']:.2f} output tok/s, "
              f"{off['total_token_throughput']:.2f} total tok/s; "
              f"server/offline output throughput: {off['server_over_offline']:.1%}")
    if args.step_log is not None:
        summary["steps"] = print_step_logs(args.step_log)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


if __name__ == "__main__":  # python -m kvfit.bench.serve
    import sys

    sys.exit(main(sys.argv[1:]))
