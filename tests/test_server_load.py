"""Load and faults on the bundled model: 64 concurrent streaming clients of mixed lengths, a
quarter of them hanging up mid-stream, a KV budget small enough to preempt. Every request that
was not abandoned must finish with the offline greedy text, none is lost, and afterwards the KV
pages are all free again (read from /metrics)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from server_common import MODEL, bundled_server, metrics, offline_greedy

WORDS = ("river mountain code kernel page cache token model light ocean music garden story "
         "engine number planet forest window paper silver quiet").split()


def _prompts(n: int, seed: int = 7) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for i in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 30))
        prompts.append(f"Request {i}: " + " ".join(words) + ".")
        max_tokens.append(rng.choice([8, 12, 16, 24]))
    return prompts, max_tokens


async def _client(http: httpx.AsyncClient, prompt: str, max_tokens: int, hang_up_after: int):
    """Stream one request; return ("done", text, finish_reason, saw_done) or ("left", chunks)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text, finish, chunks, saw_done = "", None, 0, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                saw_done = True
                break
            ev = json.loads(data)
            assert "error" not in ev, ev
            chunks += 1
            text += ev["choices"][0]["text"]
            finish = ev["choices"][0]["finish_reason"] or finish
            if hang_up_after and chunks >= hang_up_after:
                return ("left", chunks)  # leaving the `async with` closes the connection
    return ("done", text, finish, saw_done)


async def _run_all(base_url, prompts, max_tokens, leavers):
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        return await asyncio.gather(*[
            _client(http, p, m, 2 if i in leavers else 0)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))])


def _settled(base_url, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        if (m["kvfit_num_requests_running"] == 0 and m["kvfit_num_requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_64_streams_with_hangups_and_preemption():
    srv = bundled_server()
    prompts, max_tokens = _prompts(64)
    leavers = set(range(0, 64, 4))  # a quarter hang up after two chunks
    for i in leavers:
        max_tokens[i] = 24  # long enough to still be running when the client leaves
    stayers = [i for i in range(64) if i not in leavers]
    want = dict(zip(stayers, offline_greedy([prompts[i] for i in stayers],
                                            [max_tokens[i] for i in stayers])))
    before = _settled(srv.base_url)
    free0 = before["kvfit_kv_pages_free"]
    assert free0 == before["kvfit_kv_pages_total"]

    results = asyncio.run(_run_all(srv.base_url, prompts, max_tokens, leavers))

    for i, res in enumerate(results):
        if i in leavers:
            assert res[0] == "left", (i, res)
            continue
        kind, text, finish, saw_done = res
        assert kind == "done" and saw_done and finish in ("stop", "length"), (i, res)
        assert text == want[i], (i, text, want[i])
    after = _settled(srv.base_url)
    assert after["kvfit_num_requests_running"] == 0 and after["kvfit_num_requests_waiting"] == 0
    assert after["kvfit_kv_pages_free"] == free0  # nothing leaked, aborted pages included
    assert after["kvfit_num_preemptions_total"] > before["kvfit_num_preemptions_total"]
    left = after["kvfit_client_disconnects_total"] - before["kvfit_client_disconnects_total"]
    assert 1 <= left <= len(leavers)
    finished = {k: v - before.get(k, 0) for k, v in after.items()
                if k.startswith("kvfit_requests_finished_total")}
    assert sum(finished.values()) == 64  # every request is accounted for
    assert finished.get("kvfit_requests_finished_total{finish_reason=abort}", 0) == left
    # and the server still serves
    r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                   json={"prompt": prompts[1], "max_tokens": max_tokens[1], "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[1]


def test_non_streaming_disconnect_aborts():
    """A non-streaming client that times out has its request aborted and its pages freed."""
    srv = bundled_server()
    before = _settled(srv.base_url)
    body = {"prompt": "Tell me a long story about rivers.", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    try:
        httpx.post(srv.base_url + "/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(srv.base_url)
        if m["kvfit_client_disconnects_total"] > before["kvfit_client_disconnects_total"]:
            break
        time.sleep(0.2)
    after = _settled(srv.base_url)
    assert after["kvfit_client_disconnects_total"] == before["kvfit_client_disconnects_total"] + 1
    assert after["kvfit_kv_pages_free"] == before["kvfit_kv_pages_free"]
