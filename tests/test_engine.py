"""Scheduler/engine behaviour on the bundled model: batch invariance, chunked prefill,
preemption by recompute, rejection of requests that can never fit, page accounting."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import RequestRejected

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at",
           "List three colors:", "Once upon a time, in a small village,",
           "The square root of 144 is", "import numpy as np\n", "My favourite book is"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def alone(bundled_llm):
    return [_tokens(bundled_llm, [p])[0] for p in PROMPTS]


def test_batched_equals_alone(bundled_llm, alone):
    assert _tokens(bundled_llm, PROMPTS) == alone
    assert bundled_llm.engine.allocator.num_free == bundled_llm.engine.allocator.num_pages


def test_small_chunks_and_preemption_equal_alone(alone):
    # 8 requests of ~30 tokens each need ~16 pages of 4 at the end; 24 pages force preemption,
    # a 5-token step budget forces chunked prefill.
    llm = LLM("smollm2-135m", device="cpu", num_pages=24, page_size=4, max_num_batched_tokens=5,
              max_model_len=64)
    assert _tokens(llm, PROMPTS) == alone
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_abort_frees_pages(bundled_llm):
    eng = bundled_llm.engine
    free0 = eng.allocator.num_free
    eng.add_request("a", "Hello there, how are", SamplingParams(temperature=0, max_tokens=50))
    eng.add_request("b", "Counting: one, two,", SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        eng.step()
    assert eng.allocator.num_free < free0
    assert eng.abort_request("a") and eng.abort_request("b")
    assert not eng.abort_request("a")
    assert eng.allocator.num_free == free0 and not eng.has_unfinished_requests()


def test_rejects_what_can_never_fit(bundled_llm):
    eng = bundled_llm.engine
    with pytest.raises(RequestRejected, match=r"maximum context length is 2048 tokens.*"
                                              r"requested 2053 tokens"):
        eng.add_request("long", list(range(5, 10)), SamplingParams(max_tokens=2048))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejected) as e:
        SamplingParams(temperature=-1)
    assert e.value.param == "temperature"
    assert not eng.has_unfinished_requests()


def test_request_over_whole_cache_rejected():
    with pytest.raises(Exception, match="largest that fits is 64"):
        LLM("smollm2-135m", device="cpu", num_pages=16, page_size=4, max_model_len=128)


def test_stop_strings_and_seeded_sampling(bundled_llm):
    out = bundled_llm.generate("Count: 1, 2, 3, 4,", SamplingParams(
        temperature=0, max_tokens=30, stop=[" 7"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7" and " 7" not in out.text
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.05, seed=123,
                        max_tokens=16, ignore_eos=True)
    a = bundled_llm.generate(["Tell me a story"], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = bundled_llm.generate(["Hi", "Tell me a story", "x"], [sp, sp, sp],
                             use_tqdm=False)[1].outputs[0].token_ids
    assert a == b


def test_logprobs_of_chosen_tokens(bundled_llm):
    out = bundled_llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=5,
                                                            logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok] == max(lp.values()) and len(lp) >= 3  # greedy = top-1
    assert abs(c.cumulative_logprob - sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))) < 1e-4


def test_misspelt_engine_kwarg_is_an_error():
    with pytest.raises(TypeError, match="kv_cache_dtpye.*did you mean"):
        LLM("smollm2-135m", kv_cache_dtpye="fp8")


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_output_kinds_carry_the_same_tokens(bundled_llm, alone, kind):
    """step()'s output kinds: cumulative outputs end with the whole answer, deltas concatenate
    to it (logprobs too), final_only returns nothing for running requests; the text is whole."""
    eng = bundled_llm.engine
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"k{kind}{i}", p, sp)
    ids = {f"k{kind}{i}": [] for i in range(3)}
    lps = {rid: [] for rid in ids}
    last = {}
    while eng.has_unfinished_requests():
        for out in eng.step(final_only=kind == "final_only", delta=kind == "delta"):
            comp = out.outputs[0]
            assert out.finished or kind != "final_only"
            if kind == "delta":
                ids[out.request_id] += comp.token_ids
                lps[out.request_id] += comp.logprobs
            else:
                ids[out.request_id] = list(comp.token_ids)
                lps[out.request_id] = list(comp.logprobs)
            last[out.request_id] = comp
    tok = bundled_llm.get_tokenizer()
    for i in range(3):
        rid = f"k{kind}{i}"
        assert ids[rid] == list(alone[i]) and len(lps[rid]) == 24
        assert all(t in d for t, d in zip(ids[rid], lps[rid]))
        assert last[rid].text == tok.decode(alone[i], skip_special_tokens=True)


def test_request_metrics_are_ordered_and_count_preemptions():
    """``RequestOutput.metrics`` (vLLM's names): arrival <= first scheduled <= first token <=
    last token <= finished for every request, and the preemptions a small pool forces are
    counted on the requests that suffered them."""
    import time

    from kvfit.outputs import RequestMetrics

    llm = LLM("smollm2-135m", device="cpu", num_pages=24, page_size=4, max_num_batched_tokens=5,
              max_model_len=64)
    t0 = time.monotonic()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    t1 = time.monotonic()
    for o in outs:
        m = o.metrics
        assert isinstance(m, RequestMetrics)
        assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time <= t1
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions > 0
    # the requests admitted last waited in the queue longer than the first one
    assert max(o.metrics.time_in_queue for o in outs) > outs[0].metrics.time_in_queue
