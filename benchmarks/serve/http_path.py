"""How fast the server's HTTP path is without a model: a fake engine (a fixed step time, one
token per running request per step, ``time.sleep`` standing in for the GPU) served by
``kvfit serve``'s stack in a child process, loaded by ``kvfit bench serve``'s client here.

    PYTHONPATH=src python3 benchmarks/serve/http_path.py --mode process --step-ms 5
    PYTHONPATH=src python3 benchmarks/serve/http_path.py --mode thread --profile /tmp/srv.prof

Prints the client's summary next to the engine's own ceiling (requests x steps at --step-ms),
the server process's CPU seconds and the client's; ``--profile`` writes cProfile stats of the
server's event-loop thread (and of its engine thread in thread mode is not included).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time


class FakeEngine:
    """``LLMEngine``'s interface, no model: each ``step`` sleeps ``step_s`` (GIL released, like a
    GPU wait), burns ``host_s`` of Python, and gives every running request one token."""

    def __init__(self, step_s: float, host_s: float, max_num_seqs: int):
        from kvfit.outputs import CompletionOutput, RequestOutput

        self._co, self._ro = CompletionOutput, RequestOutput
        self.step_s, self.host_s, self.max_num_seqs = step_s, host_s, max_num_seqs
        self.tokenizer, self.max_model_len, self.vocab_size = None, 1 << 20, 1 << 17
        self.running: dict[str, list] = {}
        self.waiting: list = []

    def add_request(self, rid, prompt, params) -> None:
        self.waiting.append((rid, params.max_tokens or 16))

    def abort_request(self, rid) -> bool:
        self.waiting = [w for w in self.waiting if w[0] != rid]
        return self.running.pop(rid, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting)}

    def step(self, final_only: bool = False, delta: bool = False) -> list:
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, n = self.waiting.pop(0)
            self.running[rid] = [n, []]
        time.sleep(self.step_s)
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        outs = []
        for rid, st in list(self.running.items()):
            st[1].append(7)
            done = len(st[1]) >= st[0]
            ids = st[1][-1:] if delta else list(st[1])
            comp = self._co(0, "", ids, finish_reason="length" if done else None)
            if done or not final_only:
                outs.append(self._ro(rid, None, [1], [comp], done))
            if done:
                del self.running[rid]
        return outs


def _serve(port: int, mode: str, step_s: float, host_s: float, seqs: int, profile,
           merge_backlog=None) -> None:
    import cProfile
    import functools
    import signal

    from kvfit.server import serving
    from kvfit.server.launch import make_server

    if merge_backlog is not None:
        serving.MERGE_BACKLOG = merge_backlog

    server = make_server(functools.partial(FakeEngine, step_s, host_s, seqs), "fake",
                         "127.0.0.1", port, "warning", process=mode == "process")
    prof = cProfile.Profile() if profile else None
    signal.signal(signal.SIGTERM, lambda *a: setattr(server, "should_exit", True))
    t0 = time.process_time()
    if prof:
        prof.enable()
    try:
        server.run()
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        server.engine_loop.shutdown()
        print(f"server process CPU: {time.process_time() - t0:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["process", "thread"], default="process")
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--host-ms", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--profile", default=None)
    p.add_argument("--merge-backlog", type=int, default=None,
                   help="override kvfit.server.serving.MERGE_BACKLOG in the server")
    a = p.parse_args()
    from kvfit.bench.serve import format_table, run_benchmark
    from kvfit.server.launch import free_port

    port = free_port()
    proc = mp.get_context("spawn").Process(target=_serve, args=(
        port, a.mode, a.step_ms / 1e3, a.host_ms / 1e3, a.concurrency, a.profile,
        a.merge_backlog))
    proc.start()
    import httpx

    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    c0 = time.process_time()
    s = asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", "fake", a.num_prompts,
                                  a.concurrency, a.input_len, a.output_len, (1, 100)))
    client_cpu = time.process_time() - c0
    proc.terminate()
    proc.join(30)
    print(format_table(s))
    ceiling = a.concurrency / ((a.step_ms + a.host_ms) / 1e3)
    print(f"mode={a.mode} merge_backlog={a.merge_backlog}: "
          f"{s['output_throughput']:.0f} output tok/s vs the fake engine's "
          f"{ceiling:.0f} at concurrency {a.concurrency} ({s['output_throughput'] / ceiling:.0%});"
          f" client CPU {client_cpu:.2f} s over {s['duration_s']:.2f} s")


if __name__ == "__main__":
    main()
