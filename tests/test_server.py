"""kvfit serve, driven by the official openai client and raw HTTP, on the bundled SmolLM2 (CPU):
outputs equal offline greedy generation, every bad-input class gets its status and message and
the server keeps serving, /metrics parses and moves."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_common import MODEL, bundled_server, metrics, offline_greedy, offline_llm

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def srv():
    return bundled_server()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_completions_match_offline_greedy(client):
    want = offline_greedy(PROMPTS, 12)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert got.object == "text_completion" and got.usage.completion_tokens > 0
    tok = offline_llm().get_tokenizer()
    assert got.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    # streaming: one choice per prompt, concatenated deltas equal the same texts
    texts, reasons = [""] * len(PROMPTS), [None] * len(PROMPTS)
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == want
    assert all(r in ("stop", "length") for r in reasons)
    # token-id prompt (lm-eval style) gives the same text as the string prompt
    ids = tok(PROMPTS[0])["input_ids"]
    got_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert got_ids.choices[0].text == want[0]


def test_chat_matches_offline_greedy(client):
    from kvfit.sampling_params import SamplingParams

    msgs = [{"role": "user", "content": "Name three colors."}]
    want = offline_llm().chat(msgs, SamplingParams(temperature=0, max_tokens=16),
                              use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                         temperature=0)
    assert got.choices[0].message.content == want
    assert got.choices[0].message.role == "assistant" and got.object == "chat.completion"
    parts, finish, usage = [], None, None
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == want
    assert finish in ("stop", "length") and usage.completion_tokens == got.usage.completion_tokens
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=2).choices[0].logprobs
    assert len(lp.content) == 4
    for entry in lp.content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token


def test_sse_wire_format(srv):
    """Events are ``data: {...}`` separated by a blank line and the stream ends ``data: [DONE]``."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    raw = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120).text
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_n_seed_and_logprobs(client):
    kw = dict(model=MODEL, prompt="My favourite food is", max_tokens=8, temperature=1.0,
              seed=1234, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed, seed+1, seed+2: distinct samples
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16,
                                        temperature=0, stop=[","]).choices[0]
    assert "," not in stopped.text and stopped.finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    for tokstr, top in zip(lp.tokens, lp.top_logprobs):  # greedy: the chosen token is the top one
        assert max(top, key=top.get) == tokstr


def test_echo_prompt_logprobs_match_offline(client):
    """lm-eval's local-completions request: token ids, echo, logprobs, max_tokens 1."""
    from kvfit.sampling_params import SamplingParams

    tok = offline_llm().get_tokenizer()
    ids = tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    got = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0).choices[0]
    ref = offline_llm().generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                       prompt_logprobs=1), use_tqdm=False)[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert got.text.startswith(tok.decode(ids))
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref.prompt_logprobs[pos][ids[pos]],
                                                       abs=1e-3)
    # a batch of token-id prompts (lm-eval sends several per request): one choice per prompt
    ids2 = tok("Hello world")["input_ids"]
    batch = client.completions.create(model=MODEL, prompt=[ids, ids2], echo=True, logprobs=1,
                                      max_tokens=1, temperature=0)
    by_index = sorted(batch.choices, key=lambda c: c.index)
    assert [len(c.logprobs.tokens) for c in by_index] == [len(ids) + 1, len(ids2) + 1]
    assert by_index[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:],
                                                                    abs=1e-3)


BAD = [  # (body or raw bytes, status, param, words the message must contain)
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", ["temperature", "[0, 100]"]),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", ["top_p", "(0, 1]"]),
    ({"prompt": "hi", "n": 0}, 400, "n", ["n must be >= 1"]),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs", ["logprobs"]),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", ["max_tokens"]),
    ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", ["not supported"]),
    ({"prompt": [10**9]}, 400, "prompt", ["token ids"]),
    ({"prompt": []}, 400, "prompt", ["empty"]),
    ({"max_tokens": 3}, 400, "prompt", ["prompt"]),
    ({"prompt": "word " * 300, "max_tokens": 50}, 400, "prompt",
     ["maximum context length is 256 tokens", "However, you requested 351 tokens",
      "(301 in the prompt, 50 in the completion)"]),
    ({"prompt": "word " * 200, "max_tokens": 100}, 400, "max_tokens",
     ["maximum context length is 256 tokens", "301 tokens"]),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model", ["The model `gpt-9` does not exist."]),
    (b'{"prompt": "hi", "max_tokens": ', 400, None, ["JSON"]),
    (b"[1, 2]", 400, None, ["JSON object"]),
    (b"not json at all", 400, None, ["JSON"]),
]


@pytest.mark.parametrize("body,status,param,words", BAD)
def test_bad_input_errors(srv, body, status, param, words):
    url = srv.base_url + "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    assert "Traceback" not in r.text


def test_bad_chat_and_routes(srv, client):
    base = srv.base_url
    r = httpx.post(base + "/v1/chat/completions", json={"messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    long = [{"role": "user", "content": "word " * 300}]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": long, "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 400 and "in the messages" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.get(base + "/v1/nope", timeout=60)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # still serving after all of that
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_models_health_metrics(srv, client):
    assert httpx.get(srv.base_url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    before = metrics(srv.base_url)
    client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(srv.base_url)
    assert after["kvfit_generation_tokens_total"] >= before["kvfit_generation_tokens_total"] + 5
    assert after["kvfit_prompt_tokens_total"] > before["kvfit_prompt_tokens_total"]
    assert after["kvfit_time_to_first_token_seconds_count"] == \
        before["kvfit_time_to_first_token_seconds_count"] + 1
    assert after["kvfit_request_queue_time_seconds_count"] == \
        before["kvfit_request_queue_time_seconds_count"] + 1
    assert 0 <= after["kvfit_request_queue_time_seconds_sum"] - \
        before["kvfit_request_queue_time_seconds_sum"] < 60
    assert after["kvfit_inter_token_latency_seconds_count"] >= \
        before["kvfit_inter_token_latency_seconds_count"] + 4
    key = "kvfit_requests_finished_total{finish_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    assert after["kvfit_kv_pages_total"] == 24 and after["kvfit_engine_up"] == 1
    assert after["kvfit_kv_cache_info{kv_dtype=float32}"] == 1
    assert after["kvfit_kv_pages_free"] == 24 and after["kvfit_num_requests_running"] == 0
