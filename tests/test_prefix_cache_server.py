"""The server reports prefix-cache hits: usage.prompt_tokens_details.cached_tokens on the second
of two requests sharing a long prefix, and the kvfit_prefix_cache_{queries,hits} counters."""

from __future__ import annotations

import openai
from server_common import MODEL, bundled_server, metrics, offline_greedy

SHARED = ("You are a helpful assistant for a museum of natural history. Visitors ask about "
          "dinosaurs, minerals, meteorites and the evolution of mammals. Answer briefly and "
          "kindly, and suggest one exhibit to visit next. ")


def test_second_request_reports_cached_tokens():
    srv = bundled_server()
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    before = metrics(srv.base_url)
    prompts = [SHARED + "Where are the fossils?", SHARED + "What is a meteorite?"]
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
           for p in prompts]
    second = got[1].usage.prompt_tokens_details.cached_tokens
    assert second >= 32 and second % 16 == 0 and second < got[1].usage.prompt_tokens
    assert [g.choices[0].text for g in got] == offline_greedy(prompts, 6)
    after = metrics(srv.base_url)
    q = "kvfit_prefix_cache_queries_total"
    h = "kvfit_prefix_cache_hits_total"
    assert after[q] - before.get(q, 0) >= sum(g.usage.prompt_tokens for g in got)
    assert after[h] - before.get(h, 0) >= second
