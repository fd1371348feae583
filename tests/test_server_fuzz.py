"""Property-based fuzzing of `kvfit serve` from its own OpenAPI schema (schemathesis): a bounded
number of generated requests per endpoint (valid and invalid bodies) against the bundled model.
No response is a 5xx, the server keeps serving, and every KV page is free again afterwards."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from server_common import bundled_server, metrics

MAX_EXAMPLES = 50  # per endpoint (fuzzing phase); ~30 s on 2 cores, after the model load
_OUT_CAP = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}  # generated work stays small


@pytest.fixture(scope="module")
def srv():
    return bundled_server()


@pytest.fixture(scope="module")
def api_schema(srv):
    s = schemathesis.openapi.from_url(srv.base_url + "/openapi.json")
    # The coverage phase sends every boundary value of every field (~400 requests per POST
    # endpoint, minutes of decoding on CPU): the fuzzing phase, bounded by max_examples, only.
    s.config.phases.coverage.enabled = False
    return s


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(body):
    """Cap generated output lengths and n (a valid request may otherwise decode hundreds of
    tokens on CPU); values of the wrong type are left for the server to refuse."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, cap in _OUT_CAP.items():
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > cap:
            body[key] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = _OUT_CAP["max_tokens"]
    return body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_fuzz_no_server_error(case, srv):
    if case.method == "POST":
        case.body = _bounded(case.body)
    resp = case.call(timeout=120)
    assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:500])
    if resp.status_code >= 400 and case.path.startswith("/v1/"):
        err = resp.json()["error"]  # OpenAI's error shape on every refusal
        assert isinstance(err["message"], str) and err["message"]


def test_alive_and_pages_free_after_fuzz(srv):
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        m = metrics(srv.base_url)
        if m["kvfit_kv_pages_used"] == 0 and m["kvfit_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"pages still in use after the fuzz: {m}"
        time.sleep(0.2)
    assert m["kvfit_kv_pages_free"] == m["kvfit_kv_pages_total"]
    assert m["kvfit_num_requests_waiting"] == 0
    for path in ("/v1/completions", "/v1/chat/completions"):  # the fuzzer did run, with both
        codes = {k: v for k, v in m.items()  # accepted and refused requests
                 if k.startswith("kvfit_http_requests_total") and f"endpoint={path}," in k}
        print(path, codes)
        assert sum(codes.values()) >= MAX_EXAMPLES // 2, codes

