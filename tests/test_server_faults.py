"""Server faults on a tiny dummy-weight Llama (fast to start): 503 while the engine starts, every
in-flight request answered and /health 503 after the engine loop dies, graceful SIGTERM (exit 0,
in-flight streams ended)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest
from server_common import (ServerProcess, start_stream, stream_error, tiny_config,
                           tiny_engine_config)

from kvfit.server.launch import BackgroundServer


def _tiny_engine(tmp_dir):
    from kvfit.engine.llm_engine import LLMEngine

    return LLMEngine(tiny_engine_config(tmp_dir))


def test_503_while_starting(tmp_path):
    gate = threading.Event()

    def slow_factory():
        gate.wait(60)
        return _tiny_engine(tmp_path)

    srv = BackgroundServer(slow_factory, "tiny")
    thread = threading.Thread(target=srv.server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(srv.base_url + "/health")
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        gate.set()
        assert srv.engine_loop.wait_ready(60)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        gate.set()
        srv.server.should_exit = True
        thread.join(30)
        srv.engine_loop.shutdown()


def test_engine_death_answers_everyone(tmp_path):
    with BackgroundServer(lambda: _tiny_engine(tmp_path), "tiny") as srv:
        url = srv.base_url + "/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}
        streamer, lines, first = start_stream(url, body)
        non_stream: list = []
        poster = threading.Thread(target=lambda: non_stream.append(
            httpx.post(url, json=body, timeout=60)), daemon=True)
        poster.start()
        assert first.wait(30)
        engine = srv.engine_loop.engine

        def broken_step(*args, **kwargs):
            raise RuntimeError("injected fault")

        engine.step = broken_step  # the next step raises inside the engine thread
        streamer.join(30)
        poster.join(30)
        assert not streamer.is_alive() and not poster.is_alive()
        err = stream_error(lines)
        assert "injected fault" in err["message"] and err["type"] == "service_unavailable"
        assert non_stream[0].status_code == 503
        assert "injected fault" in non_stream[0].json()["error"]["message"]
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": [1], "max_tokens": 1}, timeout=10)
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/metrics").status_code == 200
        assert "kvfit_engine_up 0.0" in httpx.get(srv.base_url + "/metrics").text


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_graceful_exit_zero(tmp_path):
    with ServerProcess(tmp_path) as server:
        streamer, lines, first = start_stream(server.base + "/v1/completions", {
            "prompt": [3, 4], "max_tokens": 500, "ignore_eos": True})
        assert first.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.output()
        streamer.join(10)
        assert not streamer.is_alive()
        err = stream_error(lines)  # the stream was ended cleanly by the shutdown
        assert "shutting down" in err["message"] and err["type"] == "service_unavailable"


def test_bench_serve_runs_and_stops(tmp_path, capsys):
    """``kvfit bench serve`` on the tiny model: a bounded run, every request counted."""
    from kvfit.bench.serve import main

    out = tmp_path / "bench.json"
    rc = main(["--model", tiny_config(tmp_path), "--load-format", "dummy", "--device", "cpu",
               "--num-pages", "64", "--max-model-len", "512", "--num-prompts", "6",
               "--max-concurrency", "3", "--input-len", "8", "--output-len", "5",
               "--token-id-range", "1", "250", "--result-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["successful_requests"] == 6 and res["failed_requests"] == 0
    assert res["total_output_tokens"] == 30 and res["total_input_tokens"] == 48
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(res[key]) == {"mean", "median", "p99"} and res[key]["mean"] > 0
    assert res["itl_ms"]["mean"] == pytest.approx(res["tpot_ms"]["mean"], rel=0.05)
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_ready_logged_only_when_the_engine_is(tmp_path, caplog):
    """Issue 19: uvicorn's bind line says the engine is still loading, /health is 503 until the
    engine is up, and 'engine ready' comes after the start-up capacity line."""
    import logging

    gate = threading.Event()

    def slow_factory():
        gate.wait(60)
        return _tiny_engine(tmp_path)

    caplog.set_level(logging.INFO, logger="kvfit")
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    srv = BackgroundServer(slow_factory, "tiny", log_level="info")  # configures uvicorn logging
    uv = logging.getLogger("uvicorn.error")
    uv.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    thread = threading.Thread(target=srv.server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.base_url + "/health").status_code == 503
        running = [r.getMessage() for r in caplog.records if "Uvicorn running" in r.getMessage()]
        assert running and "still loading" in running[0] and "503" in running[0]
        assert not any(r.getMessage().startswith("engine ready") for r in caplog.records)
        gate.set()
        assert srv.engine_loop.wait_ready(60)
        assert httpx.get(srv.base_url + "/health").status_code == 200
        msgs = [r.getMessage() for r in caplog.records]
        kv = next(i for i, m in enumerate(msgs) if m.startswith("KV cache:"))
        ready = next(i for i, m in enumerate(msgs) if m.startswith("engine ready"))
        assert kv < ready
    finally:
        uv.removeHandler(caplog.handler)
        gate.set()
        srv.server.should_exit = True
        thread.join(30)
        srv.engine_loop.shutdown()
