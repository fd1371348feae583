"""OpenAI conformance of `kvfit serve` (issue 17), with the official openai client against a live
server on the bundled SmolLM2: logit_bias (applied and validated), structured output
(response_format json_object / json_schema, vLLM's structured_outputs and guided_* extras),
GET /v1/models/{id}, usage.prompt_tokens_details, the parameter policy and its validation."""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from server_common import MODEL, bundled_server, metrics, offline_greedy, offline_llm
from test_structured import SCHEMAS

from kvfit.sampling_params import SamplingParams

ASK = [{"role": "user", "content": "Give me a JSON value: a person, a list of numbers or a "
                                   "colored point."}]


@pytest.fixture(scope="module")
def srv():
    return bundled_server()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _bad(call, param: str, status: int = 400):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status, e.value
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


# ---- logit_bias ----------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_like_offline(client):
    llm = offline_llm()
    tok = llm.get_tokenizer()
    prompt = "The three primary colors are"
    forced = tok(" blue", add_special_tokens=False)["input_ids"][0]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    banned = free[0].outputs[0].token_ids[0]
    for bias, check in (({forced: 100.0}, lambda ids: ids == [forced] * 6),
                        ({banned: -100.0}, lambda ids: ids[0] != banned)):
        want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias),
                            use_tqdm=False)[0].outputs[0]
        assert check(want.token_ids)
        wire = {str(k): v for k, v in bias.items()}
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        logit_bias=wire)
        assert got.choices[0].text == want.text
    # sampling too: +100 dominates any temperature
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0,
                                    seed=5, logit_bias={str(forced): 100})
    assert got.choices[0].text == tok.decode([forced] * 4)
    # chat: the same ban as the offline chat
    msgs = [{"role": "user", "content": "Name a color."}]
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    first = free[0].outputs[0].token_ids[0]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8,
                                         logit_bias={first: -100.0}), use_tqdm=False)
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                         logit_bias={str(first): -100})
    assert want[0].outputs[0].token_ids[0] != first
    assert got.choices[0].message.content == want[0].outputs[0].text


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"49152": 1},
                                  {"12": 100.5}, {"12": -101}])
def test_logit_bias_refused(client, bias):
    _bad(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                           logit_bias=bias), "logit_bias")
    _bad(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                                logit_bias=bias), "logit_bias")


# ---- structured output ---------------------------------------------------------------------


def _schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": strict}}


def _chat_text(client, stream, messages=ASK, **kw):
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_outputs_validate(client, stream):
    for i, schema in enumerate(SCHEMAS):
        text, finish = _chat_text(client, stream, max_tokens=60, temperature=0.7, seed=i,
                                  response_format=_schema_format(schema, strict=i != 1))
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    # JSON mode: any object (a prompt the model answers briefly, so it ends within max_tokens)
    color = [{"role": "user", "content": 'Reply with a JSON object with one key, "color".'}]
    text, finish = _chat_text(client, stream, color, max_tokens=60, temperature=0,
                              response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_structured_batched_with_unconstrained(client):
    """Concurrent requests share steps: structured rows get masks, plain rows are unchanged."""
    plain = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    want = offline_greedy(plain, 12)

    def structured(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                           temperature=0.8, seed=100 + i,
                                           response_format=_schema_format(schema))
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        return True

    def unconstrained(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        s = [pool.submit(structured, i) for i in range(5)]
        u = [pool.submit(unconstrained, p) for p in plain]
        assert [f.result() for f in u] == want
        assert all(f.result() for f in s)


def test_vllm_extras_and_completions_endpoint(client):
    import re

    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8,
                                  temperature=0.9, seed=1,
                                  extra_body={"guided_choice": ["yes", "no", "not sure"]})
    assert r.choices[0].text in ("yes", "no", "not sure")
    r = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12,
                                  temperature=0.9, seed=2,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    schema = SCHEMAS[1]
    r = client.completions.create(model=MODEL, prompt="Numbers as JSON:", max_tokens=30,
                                  temperature=0, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": _schema_format(SCHEMAS[0])})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])


def test_bad_structured_specs_are_400(client):
    chat = client.chat.completions.create
    msg = _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                            response_format=_schema_format({"type": "objectx"})),
               "response_format")
    assert "objectx" in msg
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      response_format={"type": "json_schema"}), "response_format")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      response_format={"type": "xml"}), "response_format")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      extra_body={"guided_regex": "(unclosed"}), "guided_regex")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      extra_body={"guided_json": "{not json"}), "guided_json")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4,
                      extra_body={"structured_outputs": {"json": {}, "regex": "a"}}),
         "structured_outputs")
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=4, response_format={
        "type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex")


# ---- models, usage -------------------------------------------------------------------------


def test_models_retrieve(client, srv):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]
    r = httpx.get(srv.base_url + "/v1/models/org/no-such-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_usage_has_prompt_tokens_details(client):
    # a prompt no other test sends (the server is shared, and prefix caching is on): nothing
    # cached the first time; the same prompt again reuses its full pages, never the last token
    words = " ".join(f"w{i}x{uuid.uuid4().hex[:6]}" for i in range(24))
    prompt = f"Repeat: {words}"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    n_prompt = r.usage.prompt_tokens
    # chat: the template's system prefix is shared with earlier chats and may be cached
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    r = client.completions.create(model=MODEL, prompt=["a b c", "d e"], n=2, max_tokens=3,
                                  temperature=0.5, seed=3)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # shorter than one page
    usage = [c.usage for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, stream=True,
        stream_options={"include_usage": True}) if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == n_prompt
    assert 0 < usage[0].prompt_tokens_details.cached_tokens < n_prompt
    usage = [c.usage for c in client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, stream=True,
        stream_options={"include_usage": True}) if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 0


# ---- validation and the parameter policy ---------------------------------------------------


def test_validation_names_the_param(client):
    chat, cmpl = client.chat.completions.create, client.completions.create
    _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=2,
                      stream_options={"include_usage": True}), "stream_options")
    _bad(lambda: cmpl(model=MODEL, prompt="x", max_tokens=2,
                      stream_options={"include_usage": True}), "stream_options")
    for seed in (2**63, -(2**63) - 1, 10**30):
        for temp in (0.0, 1.0):
            _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=2, temperature=temp,
                              seed=seed), "seed")
            _bad(lambda: cmpl(model=MODEL, prompt="x", max_tokens=2, temperature=temp,
                              seed=seed), "seed")
    # the largest int64 seed with n=2 is fine (the second choice's seed wraps around)
    r = cmpl(model=MODEL, prompt="x", max_tokens=2, temperature=1.0, seed=2**63 - 1, n=2)
    assert len(r.choices) == 2
    vocab = offline_llm().engine.vocab_size
    for ids in ([-1], [5, vocab], [10**12]):
        _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=2,
                          extra_body={"stop_token_ids": ids}), "stop_token_ids")
    for name, value in (("presence_penalty", 0.5), ("tools", [{"type": "function", "function": {
            "name": "f", "parameters": {}}}]), ("reasoning_effort", "low")):
        _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=2, **{name: value}), name)
    for name, value in (("min_tokens", 3), ("use_beam_search", True), ("echo", True)):
        _bad(lambda: chat(model=MODEL, messages=ASK, max_tokens=2, extra_body={name: value}),
             name)


def test_unknown_fields_ignored_with_one_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="kvfit.server"):
        want = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                              temperature=0)
        got = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                             temperature=0, tool_choice="none", metadata={
                                                 "k": "v"}, store=False,
                                             extra_body={"frobnicate": 1, "zz_extra": [1]})
    assert got.choices[0].message.content == want.choices[0].message.content
    lines = [r.getMessage() for r in caplog.records if "unknown fields" in r.getMessage()]
    assert lines == ["/v1/chat/completions: ignoring unknown fields frobnicate, zz_extra"]


def test_pages_free_after(srv):
    deadline = time.monotonic() + 30
    while (m := metrics(srv.base_url))["kvfit_kv_pages_used"] != 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["kvfit_kv_pages_free"] == m["kvfit_kv_pages_total"]
