"""Scheduler + PrefixCachingAllocator without a model (nano-vllm/vLLM style): a fake KV store
records which (position, token) each slot holds, and a random workload of shared prefixes,
chunked prefill, preemption (tiny pool) and aborts checks after every step that
- no request ever writes a slot of a page someone else references or the cache holds,
- every page a request reads holds exactly that request's tokens at those positions,
- at the end every page is free or held only by the cache (free + evictable == all)."""

from __future__ import annotations

import random

import pytest

from kvfit.kvcache.prefix_cache import PrefixCachingAllocator
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import Request, Status
from kvfit.scheduler.scheduler import Scheduler

PAGE = 4


def _run(seed: int, num_pages: int, budget: int, n_requests: int = 24):
    rng = random.Random(seed)
    alloc = PrefixCachingAllocator(num_pages, lambda: ("fake", PAGE))
    sched = Scheduler(alloc, PAGE, max_num_seqs=6, max_num_batched_tokens=budget)
    kv: dict[int, dict[int, tuple[int, int]]] = {}  # page -> offset -> (position, token)
    bases = [[rng.randrange(100, 200) for _ in range(rng.randint(5, 12))] for _ in range(3)]
    reqs = []  # at most 12 + 4 prompt + 6 out = 22 tokens: fits the 6-page pool alone
    for i in range(n_requests):
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(100, 200)
                                                     for _ in range(rng.randint(0, 4))]
        r = Request(f"r{i}", None, prompt, SamplingParams(max_tokens=rng.randint(1, 6)), None, i)
        reqs.append(r)
        sched.add(r)
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not batch.empty
        for req, n in batch.items:
            start = req.num_computed_tokens
            assert n >= 1  # at least one token computed (the logits of the last one)
            for pos in range(start, start + n):  # the store: only private, uncached pages
                page = req.pages[pos // PAGE]
                assert alloc.ref_count(page) == 1 and page not in alloc._key_of, (req, pos)
                kv.setdefault(page, {})[pos % PAGE] = (pos, req.token_slice(pos, pos + 1)[0])
            for pos in range(start + n):  # the read: every slot is this request's token
                page = req.pages[pos // PAGE]
                assert kv[page][pos % PAGE] == (pos, req.token_slice(pos, pos + 1)[0])
            req.num_computed_tokens += n
        sched.cache_full_pages(batch.items)
        for req, n in batch.items:
            if req.num_computed_tokens == req.num_tokens:  # "sample" a token
                req.output_token_ids.append(100 + len(req.output_token_ids) % 3)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req, "length")
        if rng.random() < 0.05 and sched.running:  # abort someone mid-flight
            sched.finish(rng.choice(sched.running), "abort")
    assert alloc.num_free == num_pages and alloc.num_used == 0
    for p in range(num_pages):
        assert alloc.ref_count(p) == (1 if p in alloc._key_of else 0)
    assert all(r.status == Status.FINISHED for r in reqs)
    return alloc, sched


@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefix_workload_keeps_invariants(seed):
    alloc, sched = _run(seed, num_pages=12, budget=7)
    assert alloc.num_hits > 0 and alloc.num_queries >= alloc.num_hits


def test_tiny_pool_preempts_and_evicts():
    preempted = evicted = 0
    for seed in range(6):
        alloc, sched = _run(100 + seed, num_pages=6, budget=5)
        preempted += sched.num_preemptions
        evicted += alloc.num_evictions
    assert preempted > 0 and evicted > 0
