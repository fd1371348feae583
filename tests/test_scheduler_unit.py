"""The scheduler on its own, with fake model outputs (no model, no tensors), like nano-vllm's and
vLLM's tests/v1/core/test_scheduler.py: chunked prefill within the token budget, decode in
admission order, max_num_seqs, preemption by recompute (last admitted first, output tokens kept),
and every page (full and sliding) back at the end."""

from __future__ import annotations

import random

from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.sliding_pages import SlidingWindowPages
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import Request, Status
from kvfit.scheduler.scheduler import Scheduler


def _req(rid: str, prompt_len: int, max_tokens: int, arrival: int = 0) -> Request:
    ids = [(7 * i + len(rid)) % 50 + 1 for i in range(prompt_len)]
    return Request(rid, None, ids, SamplingParams(max_tokens=max_tokens), None, arrival)


def _fake_step(sched: Scheduler, batch, token: int = 9) -> list[Request]:
    """What the engine does after the model: advance each request, sample (a fixed token) for
    those whose chunk reached their last token, finish at max_tokens. Returns the finished."""
    done = []
    for req, n in batch.items:
        assert 1 <= n <= req.num_tokens - req.num_computed_tokens
        # pages cover every token computed after this step
        assert len(req.pages) * sched.page_size >= req.num_computed_tokens + n
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token + len(req.output_token_ids))
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish(req, "length")
                done.append(req)
    return done


def test_chunked_prefill_respects_the_token_budget():
    alloc = PageAllocator(64)
    sched = Scheduler(alloc, page_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = _req("a", 10, 3), _req("b", 7, 3)
    sched.add(a)
    sched.add(b)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert sum(n for _, n in batch.items) <= 8
        steps.append([(r.request_id, n) for r, n in batch.items])
        _fake_step(sched, batch)
    assert steps[0] == [("a", 8)]  # a's first chunk takes the whole budget
    assert steps[1] == [("a", 2), ("b", 6)]  # a finishes its prompt, b starts in the same step
    assert steps[2] == [("a", 1), ("b", 1)]  # a decodes, b finishes its prompt
    assert steps[3] == [("a", 1), ("b", 1)]  # both decode, in admission order
    assert a.output_token_ids == [9, 10, 11] and b.output_token_ids == [9, 10, 11]
    assert alloc.num_free == 64 and not sched.running and not sched.waiting


def test_max_num_seqs_limits_running_requests():
    alloc = PageAllocator(64)
    sched = Scheduler(alloc, page_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [_req(f"r{i}", 5, 2 + i, i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    finished_order = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert len(sched.running) <= 2 and len(batch.items) <= 2
        ids = [r.request_id for r, _ in batch.items]
        assert ids == sorted(ids, key=lambda x: int(x[1:]))  # running ones in admission order
        finished_order += [r.request_id for r in _fake_step(sched, batch)]
    assert finished_order == ["r0", "r1", "r2", "r3"]
    assert alloc.num_free == 64


def test_preemption_recomputes_the_last_admitted_and_keeps_its_outputs():
    page = 4
    alloc = PageAllocator(6)  # 24 tokens: not enough for both to finish at once
    sched = Scheduler(alloc, page_size=page, max_num_seqs=4, max_num_batched_tokens=32)
    first, second = _req("first", 8, 8, 0), _req("second", 8, 8, 1)
    sched.add(first)
    sched.add(second)
    preempted_with: list[list[int]] = []
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        for victim in batch.preempted:
            assert victim is second  # the newest running request goes first
            assert victim.status == Status.WAITING and victim.pages == []
            assert victim.num_computed_tokens == 0 and sched.waiting[0] is victim
            preempted_with.append(list(victim.output_token_ids))
        _fake_step(sched, batch)
        assert alloc.num_used == sum(len(r.pages) for r in sched.running)
        steps += 1
        assert steps < 100
    assert sched.num_preemptions == len(preempted_with) >= 1
    assert second.num_preemptions == sched.num_preemptions and first.num_preemptions == 0
    assert any(preempted_with)  # it had produced tokens when preempted ...
    # ... and kept them: the recompute continued the same sequence to max_tokens
    assert second.output_token_ids == first.output_token_ids == list(range(9, 17))
    assert alloc.num_free == 6


def test_a_lone_request_that_cannot_grow_preempts_itself():
    alloc = PageAllocator(2)
    sched = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    r = _req("r", 8, 4)
    sched.add(r)
    _fake_step(sched, sched.schedule())  # 8 tokens fill both pages, one output token
    batch = sched.schedule()  # the 9th token needs a third page: none, nobody else to preempt
    assert batch.items == [] and batch.preempted == [r]
    assert r.status == Status.WAITING and alloc.num_free == 2 and r.output_token_ids == [9]


def test_abort_frees_pages_of_running_and_waiting():
    alloc = PageAllocator(16)
    sched = Scheduler(alloc, page_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _req("a", 9, 5), _req("b", 3, 5)
    sched.add(a)
    sched.add(b)
    _fake_step(sched, sched.schedule())
    assert a.status == Status.RUNNING and b.status == Status.WAITING and alloc.num_used == 3
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert alloc.num_free == 16 and not sched.has_unfinished()
    assert a.finish_reason == b.finish_reason == "abort"


def test_random_workload_returns_every_page():
    rng = random.Random(3)
    page, window = 4, 6
    alloc = PageAllocator(20)
    sliding = SlidingWindowPages(14, page, window)
    sched = Scheduler(alloc, page, max_num_seqs=3, max_num_batched_tokens=10, sliding=sliding)
    reqs = [_req(f"q{i}", rng.randint(1, 20), rng.randint(1, 12), i) for i in range(12)]
    for r in reqs:
        sched.add(r)
    most_sliding = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert sum(n for _, n in batch.items) <= 10
        for req, n in batch.items:  # sliding pages cover what the step reads and writes
            table = sliding.table(req.request_id)
            first = max(0, req.num_computed_tokens - window + 1) // page
            end = -(-(req.num_computed_tokens + n) // page)
            assert all(p >= 0 for p in table[first:end])
        _fake_step(sched, batch)
        if rng.random() < 0.5:  # returning pages early is optional (reserve releases them too)
            for req in sched.running:
                sliding.release(req.request_id, req.num_computed_tokens)
        most_sliding = max(most_sliding, sliding.num_used)
    assert not sched.has_unfinished()
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert alloc.num_free == 20 and sliding.num_free == 14
    assert most_sliding <= 14
