"""--kv-dtype int4 through the engine on the bundled SmolLM2-135M (float32 compute, torch
reference backend): prefix caching on equals off, chunked prefill + preemption equal the same
batch without preemption, aborts, every page and residual slot returned.

NOTE: 4-bit codes turn float noise into whole quantization steps (a K value one ulp across a
rounding boundary moves by scale/2), so outputs are compared between runs whose steps put the
same tokens through the same matmul shapes: prefill chunks of 32 tokens = one page, so a
cached prefix (whole pages) leaves the rest chunked exactly as without caching."""

from __future__ import annotations

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.bench.quality import chat_prompts, quality_text, sequence_logprobs
from kvfit.kvcache.int4_pool import Int4KVCache

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and "
          "never repeat the question. The user is a student of geography and history, and "
          "asks about places, people and dates.\n")
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "How tall is Everest?",
             "Name a river in Egypt."]


def _llm(**kw):
    args = dict(device="cpu", kv_dtype="int4", num_tokens=2048, max_model_len=512,
                max_num_seqs=4, max_num_batched_tokens=32)
    args.update(kw)
    return LLM("smollm2-135m", **args)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_returned(llm):
    eng = llm.engine
    pool = eng.runner.pool
    assert isinstance(pool, Int4KVCache)
    assert pool.residual_slots.num_free == pool.residual_slots.num_slots
    assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.fixture(scope="module")
def off():
    return _llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(off):
    tok = off.get_tokenizer()
    return [tok(SYSTEM + q)["input_ids"] for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(off, prompts):
    return [_tokens(off.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]


def test_prefix_caching_shares_full_pages_only_and_equals_caching_off(prompts, alone):
    assert all(len(p) > 40 for p in prompts)  # the shared system text fills a page of 32
    llm = _llm(enable_prefix_caching=True)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert _tokens(outs) == alone
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens % 32 == 0 and o.num_cached_tokens >= 32 for o in outs[1:])
    _check_returned(llm)


def test_chunked_prefill_and_preemption_match_no_preemption(off, prompts):
    """4 requests of ~50 + 40 tokens need 3 pages of 32 each at the end; 8 pages force
    preemption; the 32-token step budget split between requests chunks prefills across page
    boundaries (pages completed from the residual slot).

    A preempted request recomputes its decoded tokens as one prefill chunk: other matmul shapes,
    so float noise, which a 4-bit code turns into a whole step (measured: 3/4 answers identical,
    the recomputed one diverging at token 20 of 40). The exact property, stored pages independent
    of chunking and slot, is tests/test_int4.py::test_residual_flush_equals_quantizing_full_pages.
    Here: no answer derails early (a lost residual or a page quantized from stale rows would
    change the next token at once) and most stay identical.
    """
    want = _tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(enable_prefix_caching=False, num_tokens=None, num_pages=8, max_model_len=128)
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for a, b in zip(got, want)]
    print(f"tokens in agreement before the first difference: {same} of {len(want[0])}")
    assert sum(s == len(w) for s, w in zip(same, want)) >= 3 and min(same) >= 10
    _check_returned(llm)
    _check_returned(off)


def test_abort_mid_prefill_returns_the_slot(off, prompts):
    eng = off.engine
    eng.add_request("abort-me", prompts[0] + prompts[1], SamplingParams(max_tokens=4))
    eng.scheduler.max_num_batched_tokens = 40
    try:
        eng.step()
        assert eng.runner.pool.residual_slots.holds("abort-me")
        assert eng.abort_request("abort-me")
    finally:
        eng.scheduler.max_num_batched_tokens = off.config.max_num_batched_tokens
    _check_returned(off)


def test_int4_agrees_with_float32_kv(off, bundled_llm):
    """Greedy agreement and KL against the float32 cache on the quality bench's 12 prompts.

    Measured (`kvfit bench quality --model smollm2-135m --kv-dtypes auto fp8_e4m3 int4
    --context 1024 --keys 2 --kl-tokens 1536`, docs/benchmarks.md): int4 5/12 identical
    48-token answers (fp8_e4m3: 4/12), first divergence median 5, mean KL 0.0119 (fp8 0.0070),
    passkey 6/6. Floors: half the agreement (>= 2/12) and a mean KL below 3x the measured one
    over 400 tokens; a broken path (wrong nibble order, scale or residual) diverges at the first
    token of every prompt with KL >> 0.1.
    """
    tok = off.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in chat_prompts(tok)]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _tokens(bundled_llm.generate(prompts, params, use_tqdm=False))
    got = _tokens(off.generate(prompts, params, use_tqdm=False))
    identical = sum(a == b for a, b in zip(got, want))
    ids = tok(quality_text())["input_ids"][:400]
    ref = torch.cat(list(sequence_logprobs(bundled_llm.engine, ids, 512)))
    lp = torch.cat(list(sequence_logprobs(off.engine, ids, 512)))
    kl = (ref.exp() * (ref - lp)).sum(-1)
    print(f"int4 vs float32 KV: {identical}/{len(want)} identical, KL mean {kl.mean():.4f}")
    assert identical >= 2
    assert torch.isfinite(lp).all() and kl.mean() < 0.036
    _check_returned(off)
