"""The engine in its own process (``EngineLoop(process=True)``, what ``kvfit serve`` runs): a
killed engine process fails the in-flight requests with 503 and /health turns 503; an engine
that cannot start ends the server; a lagging stream's Deltas merge into one."""

from __future__ import annotations

import asyncio
import functools
import os
import signal

import httpx
from server_common import start_stream, stream_error, tiny_engine_config

from kvfit.server.engine_loop import Delta
from kvfit.server.launch import BackgroundServer
from kvfit.server.serving import MERGE_BACKLOG, Submission, merge_deltas


def test_killed_engine_process_answers_everyone(tmp_path):
    from kvfit.server.launch import engine_launch_kwargs

    kwargs = engine_launch_kwargs(tiny_engine_config(tmp_path))
    with BackgroundServer(served_model_name="tiny", **kwargs) as srv:
        url = srv.base_url + "/v1/completions"
        assert srv.engine_loop.engine is None  # it lives in the other process
        t, lines, first = start_stream(url, {"prompt": [5, 6, 7], "max_tokens": 480,
                                             "ignore_eos": True})
        assert first.wait(60)
        os.kill(srv.engine_loop._channel.proc.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        err = stream_error(lines)
        assert "exited unexpectedly" in err["message"] and err["type"] == "service_unavailable"
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1}, timeout=10)
        assert r.status_code == 503


def test_engine_process_start_failure_is_reported(tmp_path):
    from kvfit.config import make_config
    from kvfit.engine.llm_engine import LLMEngine

    bad = make_config(model=str(tmp_path / "missing.gguf"), device="cpu")
    srv = BackgroundServer(functools.partial(LLMEngine, bad), "x", process=True)
    try:
        srv.start(timeout=120)
        raise AssertionError("the server started without an engine")
    except RuntimeError as e:
        assert "engine failed to start" in str(e)
    assert srv.engine_loop.state == "dead"


def test_merge_deltas_keeps_everything():
    a = Delta("ab", [1, 2], [{1: -0.1}, {2: -0.2}], 2, None, [None, {3: -1.0}])
    b = Delta("abc", [3], [{3: -0.3}], 3, "length")
    m = merge_deltas(a, b)
    assert m == Delta("abc", [1, 2, 3], [{1: -0.1}, {2: -0.2}, {3: -0.3}], 3, "length",
                      [None, {3: -1.0}])
    assert merge_deltas(Delta("", [1], None, 1, None), Delta("", [2], None, 2, None)) \
        .new_logprobs is None


def test_lagging_stream_merges_only_past_the_backlog():
    async def run(n_waiting: int) -> list:
        sub = Submission.__new__(Submission)  # events() only needs the queue and bookkeeping
        sub.queue, sub._buffer, sub.unfinished = asyncio.Queue(), [], {0}
        sub._next_check, sub.loop, sub.raw = float("inf"), None, None
        for k in range(n_waiting):
            last = k == n_waiting - 1
            sub.queue.put_nowait((0, "output", Delta("", [k], None, k + 1,
                                                     "length" if last else None)))
        return [d.new_token_ids async for _, d in sub.events(poll_client=False)]

    few = asyncio.run(run(MERGE_BACKLOG - 1))
    assert few == [[k] for k in range(MERGE_BACKLOG - 1)]  # one chunk per step
    many = asyncio.run(run(MERGE_BACKLOG + 2))
    assert many == [list(range(MERGE_BACKLOG + 2))]  # the backlog folded into one
