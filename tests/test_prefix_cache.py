"""Automatic prefix caching: the allocator's bookkeeping (sharing, LRU eviction, identity) and
the engine's outputs with caching on equal caching off on the bundled SmolLM2 (shared-prefix
batches, chunked prefill + preemption, aborts mid-prefill, fp8 pools, prefixes ending mid-page,
a prefix evicted and recomputed), plus MLA (works) and sliding-window (refused) pools."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.kvcache.prefix_cache import (PrefixCachingAllocator, extend_page_keys, kv_identity,
                                        root_key)

PAGE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and "
          "never repeat the question. The user is a student of geography and history.\n")
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How tall is Everest?",
             "Name a river in Egypt.", "When did Rome fall?", "What is the capital of Peru?"]


def _identity(tag="a"):
    return lambda: (tag, "float32", PAGE)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_pages_returned(llm):
    """Everything finished: free + evictable cached == all pages, and every page holds either no
    reference or only the cache's."""
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and a.num_used == 0
    cached = set(a._key_of) if isinstance(a, PrefixCachingAllocator) else set()
    for p in range(a.num_pages):
        assert a.ref_count(p) == (1 if p in cached else 0), p


# -- the allocator alone ----------------------------------------------------------------------
def test_allocator_shares_caches_and_evicts_lru():
    a = PrefixCachingAllocator(6, _identity())
    tokens = random.Random(0).sample(range(1000), 12)
    keys: list[bytes] = []
    extend_page_keys(keys, a.root, lambda s, e: tokens[s:e], 11, PAGE)
    assert len(keys) == 2  # only full pages among the first 11 tokens
    pages = a.allocate(3)
    for p, k in zip(pages, keys):
        assert a.register(p, k)
    assert not a.register(pages[2], keys[0])  # a key maps to one page
    assert a.lookup(keys) == pages[:2] and a.num_cached == 2
    a.free(pages)
    assert a.num_free == 6 and a.num_evictable == 2 and a.ref_count(pages[0]) == 1
    hit = a.lookup(keys)
    a.share(hit)  # a second request maps the prefix: no longer evictable
    assert a.num_free == 4 and a.ref_count(hit[0]) == 2
    a.free(hit)
    # the pool runs short: the least recently freed cached page goes first (tail before prefix)
    got = a.allocate(5)
    assert a.num_evictions == 1 and pages[1] in got and a.lookup(keys) == [pages[0]]
    a.free(got)
    a.allocate(6)
    assert a.num_cached == 0 and a.lookup(keys) == []


def test_allocator_reset_forgets_cached_pages_but_not_pages_in_use():
    a = PrefixCachingAllocator(6, _identity())
    tokens = random.Random(5).sample(range(1000), 8)
    keys: list[bytes] = []
    extend_page_keys(keys, a.root, lambda s, e: tokens[s:e], 8, PAGE)
    pages = a.allocate(2)
    for p, k in zip(pages, keys):
        assert a.register(p, k)
    a.free(pages[1:])  # page 1: evictable; page 0: still used by its request
    assert a.reset() == 2
    assert a.num_cached == 0 and a.lookup(keys) == [] and a.num_evictable == 0
    assert a.ref_count(pages[0]) == 1 and a.ref_count(pages[1]) == 0
    a.free(pages[:1])
    assert a.num_free == 6 and all(a.ref_count(p) == 0 for p in range(6))


def test_keys_chain_over_the_whole_prefix_and_the_kv_identity():
    toks = list(range(100, 116))
    k1, k2, k3 = [], [], []
    root = root_key(("m", "float32", PAGE))
    extend_page_keys(k1, root, lambda s, e: toks[s:e], 16, PAGE)
    other = toks[:3] + [7] + toks[4:]  # differs in page 0 only
    extend_page_keys(k2, root, lambda s, e: other[s:e], 16, PAGE)
    assert all(x != y for x, y in zip(k1, k2))  # every later page's key differs too
    extend_page_keys(k3, root_key(("m", "fp8_e4m3", PAGE)), lambda s, e: toks[s:e], 16, PAGE)
    assert not set(k1) & set(k3)  # another KV format
    k4: list[bytes] = []
    extend_page_keys(k4, root_key(("m2", "float32", PAGE)), lambda s, e: toks[s:e], 16, PAGE)
    assert not set(k1) & set(k4)  # another model


def test_identity_change_drops_cached_pages():
    ident = {"v": ("m", 1.0)}
    a = PrefixCachingAllocator(4, lambda: ident["v"])
    p = a.allocate(2)
    a.register(p[0], b"k0")
    a.register(p[1], b"k1")
    a.free(p[:1])
    ident["v"] = ("m", 2.0)  # a new scale: the stored bytes mean something else
    a.check_identity()
    assert a.num_cached == 0 and a.lookup([b"k0"]) == [] and a.root == root_key(("m", 2.0))
    assert a.ref_count(p[0]) == 0 and a.ref_count(p[1]) == 1  # p[1] still with its request
    a.free(p[1:])
    assert a.num_free == 4


def test_flags_on_by_default_and_vllm_off_switch():
    from kvfit.config import add_engine_args, config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).enable_prefix_caching
    assert not config_from_args(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    assert config_from_args(p.parse_args(["--enable-prefix-caching"])).enable_prefix_caching


# -- the engine on the bundled model -------------------------------------------------------------
def _llm(caching: bool, **kw):
    args = dict(device="cpu", page_size=PAGE, num_tokens=2048, max_model_len=256,
                enable_prefix_caching=caching)
    args.update(kw)
    return LLM("smollm2-135m", **args)


@pytest.fixture(scope="module")
def on():
    return _llm(True)


@pytest.fixture(scope="module")
def off():
    return _llm(False)


@pytest.fixture(scope="module")
def prompts(on):
    tok = on.get_tokenizer()
    return [tok(SYSTEM + q)["input_ids"] for q in QUESTIONS]


def test_shared_prefix_batch_equals_caching_off(on, off, prompts):
    assert on.engine.prefix_caching and not off.engine.prefix_caching
    want = _tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    q0, h0 = on.engine.stats()["prefix_cache_queries"], on.engine.stats()["prefix_cache_hits"]
    outs = on.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want and list(first.outputs[0].token_ids) == want[0]
    shared = len(on.get_tokenizer()(SYSTEM)["input_ids"])
    floor = (shared - 2) // PAGE * PAGE  # the system text's full pages (its last token may merge)
    for o, p in zip(outs, prompts):
        assert floor <= o.num_cached_tokens <= (len(p) - 1) // PAGE * PAGE
    s = on.engine.stats()
    assert s["prefix_cache_queries"] - q0 == sum(map(len, prompts))
    assert s["prefix_cache_hits"] - h0 == sum(o.num_cached_tokens for o in outs)
    assert s["pages_cached"] > 0
    _check_pages_returned(on)


def test_reset_prefix_cache_makes_the_next_request_prefill(on, prompts):
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    again = on.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert on.reset_prefix_cache() and on.engine.stats()["pages_cached"] == 0
    after = on.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert list(after.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    _check_pages_returned(on)


def test_prefix_ending_mid_page_and_whole_prompt_cached(on, off):
    rng = random.Random(1)
    base = [rng.randrange(1000, 40000) for _ in range(22)]  # 5 full pages + 2 tokens
    prompts = [base[:10] + [rng.randrange(1000, 40000) for _ in range(5)],  # shares 10 = 2.5 pages
               base,  # repeated whole: the last token's page is never reused
               base, base[:12]]  # a prompt that is exactly 3 cached pages
    for p in prompts:  # one at a time, so each sees what the previous ones cached
        o = on.generate([p], GREEDY, use_tqdm=False)[0]
        assert _tokens([o]) == _tokens(off.generate([p], GREEDY, use_tqdm=False))
        assert o.num_cached_tokens <= (len(p) - 1) // PAGE * PAGE
    assert o.num_cached_tokens == 8  # base[:12]: 3 pages cached, the last one recomputed
    _check_pages_returned(on)


def test_decode_pages_are_cached_for_the_next_turn(on, off):
    """Multi-turn: the next turn resends prompt + answer; the answer's pages (filled by decode)
    are hits too."""
    rng = random.Random(2)
    turn1 = [rng.randrange(1000, 40000) for _ in range(9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a1 = on.generate([turn1], params, use_tqdm=False)[0].outputs[0].token_ids
    turn2 = turn1 + list(a1) + [rng.randrange(1000, 40000) for _ in range(3)]
    o = on.generate([turn2], params, use_tqdm=False)[0]
    assert o.num_cached_tokens == (len(turn1) + len(a1) - 1) // PAGE * PAGE
    assert _tokens([o]) == _tokens(off.generate([turn2], params, use_tqdm=False))


def test_abort_mid_prefill_then_reuse(on, off, prompts):
    eng = on.engine
    free0 = eng.allocator.num_free
    long = prompts[2] + prompts[3]
    eng.add_request("abort-me", long, SamplingParams(temperature=0, max_tokens=8))
    eng.scheduler.max_num_batched_tokens = 9  # chunked: the abort lands mid-prefill
    try:
        eng.step()
        eng.step()
        req = eng.requests["abort-me"]
        assert 0 < req.num_computed_tokens < len(long)
        assert eng.abort_request("abort-me")
    finally:
        eng.scheduler.max_num_batched_tokens = on.config.max_num_batched_tokens
    assert eng.allocator.num_free == free0
    o = on.generate([long], GREEDY, use_tqdm=False)[0]
    assert o.num_cached_tokens >= 16  # what the aborted prefill completed is reused
    assert _tokens([o]) == _tokens(off.generate([long], GREEDY, use_tqdm=False))
    _check_pages_returned(on)


def test_preemption_and_chunks_equal_caching_off(off, prompts):
    """A tiny pool: 6 requests of ~40 tokens + 8 out (8 shared pages + ~4 each) do not fit in
    20 pages of 4, so requests are preempted (their cached pages stay cached) and cached
    prefixes are evicted and recomputed."""
    want = _tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(True, num_tokens=None, num_pages=20, max_model_len=64, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.allocator.num_evictions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    _check_pages_returned(llm)
    # evict the system prompt entirely (unrelated prompts fill the pool), then resend
    rng = random.Random(3)
    filler = [[rng.randrange(1000, 40000) for _ in range(48)] for _ in range(3)]
    llm.generate(filler, GREEDY, use_tqdm=False)
    o = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert o.num_cached_tokens == 0 and _tokens([o]) == want[:1]
    _check_pages_returned(llm)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_equals_caching_off(kv_dtype, prompts):
    # one request at a time in both: an fp8 cache turns the float noise of a different batch
    # composition into rounding flips (batched vs alone differs with caching off too)
    kw = dict(kv_dtype=kv_dtype, num_tokens=1024, max_num_batched_tokens=16)
    ref = _llm(False, **kw)
    want = [_tokens(ref.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:4]]
    llm = _llm(True, **kw)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:4]]
    assert _tokens(outs) == want
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
    _check_pages_returned(llm)


def test_scale_change_never_reuses_stale_pages(prompts):
    llm = _llm(True, kv_dtype="fp8_e4m3", num_tokens=1024)
    pool = llm.engine.runner.pool
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert llm.engine.allocator.num_cached > 0
    pool.set_scales([2.0] * pool.num_layers, [2.0] * pool.num_layers)  # e.g. a recalibration
    o = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0]
    assert o.num_cached_tokens == 0  # the old pages were stored under scale 1.0
    again = llm.generate(prompts[2:3], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # pages stored under the new scale are reused


def test_no_hit_for_requests_that_want_prompt_logprobs(on, prompts):
    on.generate(prompts[:1], GREEDY, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    o = on.generate(prompts[:1], sp, use_tqdm=False)[0]
    assert o.num_cached_tokens == 0 and len(o.prompt_logprobs) == len(prompts[0])


# -- other pools -------------------------------------------------------------------------------
def test_mla_pool_caches_and_matches_hf(tmp_path):
    from test_gemma3 import tiny_tokenizer_dir
    from test_mla import _hf_and_ours

    cfg, hf, _ = _hf_and_ours("lite", seed=4)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    tiny_tokenizer_dir(tmp_path, cfg.vocab_size)
    llm = LLM(str(tmp_path), device="cpu", num_tokens=256, max_model_len=128, page_size=PAGE,
              max_num_batched_tokens=5)
    assert llm.engine.runner.pool.name == "MLAKVCache" and llm.engine.prefix_caching
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, cfg.vocab_size, (14,), generator=g).tolist()
    prompts = [shared + torch.randint(0, cfg.vocab_size, (3,), generator=g).tolist()
               for _ in range(3)]
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12]
    for p, o in zip(prompts, outs):
        toks = list(o.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks])).logits[0].float()
        assert ref[len(p) - 1:-1].argmax(-1).tolist() == toks
    _check_pages_returned(llm)


def test_sliding_window_pool_runs_with_caching_off(tmp_path, caplog):
    from test_gemma3 import _hf_and_ours, engine_matches_hf

    cfg, hf, _ = _hf_and_ours("gemma3", seed=4)
    with caplog.at_level("INFO", logger="kvfit"):
        llm = engine_matches_hf(tmp_path, hf, cfg.vocab_size)
    assert not llm.engine.prefix_caching and not llm.engine.stats()["prefix_caching"]
    assert any("prefix caching: off" in r.message and "sliding-window" in r.message
               for r in caplog.records)


def test_kv_identity_names_format_scales_and_page_size(on):
    pool = on.engine.runner.pool
    ident = kv_identity(("smollm2-135m",), pool)
    assert "float32" in ident and PAGE in ident and tuple(pool.k_scales) in ident
