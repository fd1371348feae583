"""Overlap (async) scheduling on the CPU path: the engine launches step N+1 before it reads step
N's sampled ids, so decode inputs come from the previous step's device ids and a request that
stops at N has one discarded extra token. Outputs must equal the synchronous engine exactly."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at",
           "List three colors:", "Once upon a time, in a small village,",
           "The square root of 144 is", "import numpy as np\n", "My favourite book is"]


def _gen(llm, prompts, sp):
    return llm.generate(prompts, sp, use_tqdm=False)


@pytest.fixture(scope="module")
def overlap_llm():
    llm = LLM("smollm2-135m", device="cpu", num_tokens=16384, max_model_len=2048,
              async_scheduling="on")
    assert llm.engine.overlap
    return llm


def _pages_back(llm):
    eng = llm.engine
    assert eng.allocator.num_free == eng.allocator.num_pages
    assert not eng.has_unfinished_requests()


def test_greedy_batch_equals_sync(bundled_llm, overlap_llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _gen(bundled_llm, PROMPTS, sp)]
    got = _gen(overlap_llm, PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(len(o.outputs[0].token_ids) == 20 and o.outputs[0].finish_reason == "length"
               for o in got)
    _pages_back(overlap_llm)


def test_stops_discard_the_extra_token(bundled_llm, overlap_llm):
    # each request stops at a different step (stop token id, stop string, max_tokens), while
    # the others keep decoding: the step after a stop computed one token that must not appear
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _gen(bundled_llm, PROMPTS, base)]
    sps = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                          stop_token_ids=[ref[i][3 + i]]) for i in range(len(PROMPTS))]
    sps[1] = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sps[2] = SamplingParams(temperature=0, max_tokens=30, stop=[" 7", "\n"])
    want = _gen(bundled_llm, PROMPTS, sps)
    got = _gen(overlap_llm, PROMPTS, sps)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.text, w.finish_reason, w.stop_reason)
    assert got[0].outputs[0].token_ids[-1] == ref[0][3] and got[0].outputs[0].stop_reason == ref[0][3]
    assert len(got[1].outputs[0].token_ids) == 5
    _pages_back(overlap_llm)


def test_seeded_sampling_and_logprobs_equal_sync(bundled_llm, overlap_llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.05, seed=123,
                        max_tokens=12, ignore_eos=True, logprobs=2)
    want = _gen(bundled_llm, ["Hi", "Tell me a story", "x"], [sp] * 3)
    got = _gen(overlap_llm, ["Hi", "Tell me a story", "x"], [sp] * 3)
    alone = _gen(overlap_llm, ["Tell me a story"], sp)[0].outputs[0]
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids
        assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs]
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    assert alone.token_ids == got[1].outputs[0].token_ids
    _pages_back(overlap_llm)


def test_prompt_logprobs_equal_sync(bundled_llm, overlap_llm):
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    w = _gen(bundled_llm, ["The sky is blue and the grass is"], sp)[0]
    g = _gen(overlap_llm, ["The sky is blue and the grass is"], sp)[0]
    assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
    for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
        assert sorted(a) == sorted(b)
        assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def test_chunks_and_preemption_equal_sync(bundled_llm):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _gen(bundled_llm, PROMPTS, sp)]
    llm = LLM("smollm2-135m", device="cpu", num_pages=24, page_size=4, max_num_batched_tokens=5,
              max_model_len=64, async_scheduling="on")
    assert [o.outputs[0].token_ids for o in _gen(llm, PROMPTS, sp)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    _pages_back(llm)


def test_abort_in_flight_frees_pages(overlap_llm):
    eng = overlap_llm.engine
    free0 = eng.allocator.num_free
    sp = SamplingParams(temperature=0, max_tokens=50)
    eng.add_request("a", "Hello there, how are", sp)
    eng.add_request("b", "Counting: one, two,", sp)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None  # a launched step whose ids are not read yet
    assert eng.allocator.num_free < free0
    assert eng.abort_request("a") and eng.abort_request("b")
    assert eng.allocator.num_free == free0 and not eng.has_unfinished_requests()
    assert eng.step() == []  # the in-flight step's tokens are discarded
    assert eng.allocator.num_free == free0


def test_length_capped_request_is_not_scheduled_again(overlap_llm):
    # max_tokens is known at launch: the step that produces the last token is the last launch
    eng = overlap_llm.engine
    launches = []
    execute = eng.runner.execute
    eng.runner.execute = lambda items, *a: launches.append(len(items)) or execute(items, *a)
    try:
        eng.add_request("one", "Hello", SamplingParams(temperature=0, max_tokens=3,
                                                       ignore_eos=True))
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
    finally:
        eng.runner.execute = execute
    assert launches == [1, 1, 1]  # prefill + 2 decodes, no wasted 4th forward
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 3
    _pages_back(overlap_llm)


def test_async_scheduling_flag_validated():
    from kvfit.config import make_config

    assert not make_config(device="cpu").resolved_async_scheduling
    assert make_config(device="cpu", async_scheduling="on").resolved_async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        make_config(async_scheduling="yes")


def test_prefix_cache_under_overlap(overlap_llm):
    # multi-turn: each turn resends the history, so turn 2 reuses turn 1's prompt AND decode
    # pages; under overlap a decode page is registered one step late (its last id is still on
    # the device when the step launches) and must never be keyed with a placeholder
    tok = overlap_llm.get_tokenizer()
    system = tok.encode("You are a careful assistant. " * 24)  # ~ 150 tokens, several pages
    turns = [system + tok.encode(q) for q in ("Name a fruit.", "Name a city.", "Count to five.")]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = LLM("smollm2-135m", device="cpu", num_tokens=16384, max_model_len=2048,
              enable_prefix_caching=False)
    hits0 = overlap_llm.engine.stats()["prefix_cache_hits"]
    for _ in range(2):  # turn 1, then turn 2 = turn 1 + its answer + a follow-up
        want = _gen(off, [{"prompt_token_ids": t} for t in turns], sp)
        got = _gen(overlap_llm, [{"prompt_token_ids": t} for t in turns], sp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        turns = [t + list(o.outputs[0].token_ids) + tok.encode(" And another?")
                 for t, o in zip(turns, got)]
    assert overlap_llm.engine.stats()["prefix_cache_hits"] > hits0
    assert any(o.num_cached_tokens > len(system) for o in got)  # turn 2 hit turn 1's decode pages
    _pages_back(overlap_llm)
