"""Continuous batching with chunked prefill and preemption by recompute.

Every step, running requests come first (in admission order): each gets
``min(tokens not yet in the cache, remaining budget)`` tokens, 1 for a decoding request. Pages are
allocated for what is scheduled; when none are free, the most recently admitted running request
is preempted (pages freed, progress reset, back to the front of the waiting queue) — the request
being scheduled preempts itself if it is the last one. Then waiting requests are admitted while
the token budget, ``max_num_seqs`` and free pages allow. Nothing is ever dropped: requests that
could never fit are refused by the engine before they get here.

Prefix caching (when the allocator is a ``PrefixCachingAllocator``): a request admitted with
nothing computed first maps its longest cached full-page prefix (``_map_cached_prefix``) and
prefills only the rest; ``cache_full_pages`` registers pages once every slot of them is computed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.prefix_cache import PrefixCachingAllocator, extend_page_keys
from kvfit.scheduler.request import Request, Status

log = logging.getLogger("kvfit")


@dataclass
class ScheduledBatch:
    """The step's work: (request, number of new tokens) in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.items


class Scheduler:
    """Owns the waiting queue, the running list and the page allocator (mutates requests' pages
    and status). Never touches the GPU."""

    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, sliding=None, residual=None):
        self.allocator = allocator
        self.sliding = sliding  # the pool's sliding_pages (SlidingWindowPages) or None
        # the int4 pool's residual_slots (ResidualSlots) or None: a request holds one slot from
        # its first pages until it releases them (finish, abort, preemption)
        self.residual = residual
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.cache = allocator if isinstance(allocator, PrefixCachingAllocator) else None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` the pages (and sliding-window pages, and a residual slot) for
        ``num_tokens`` cached tokens; False, changing nothing, when they are not free."""
        need = self.pages_for(num_tokens) - len(req.pages)
        start, rid = req.num_computed_tokens, req.request_id
        if self.sliding is not None and not self.sliding.can_reserve(rid, start, num_tokens):
            return False
        if self.residual is not None and not self.residual.can_assign(rid):
            return False
        if need > 0 and not self.allocator.can_allocate(need):
            return False
        if need > 0:
            req.pages.extend(self.allocator.allocate(need))
        if self.sliding is not None:
            self.sliding.reserve(rid, start, num_tokens)
        if self.residual is not None:
            self.residual.assign(rid)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        log.info("preempted request %s (recompute; %d pages free)", req.request_id,
                 self.allocator.num_free)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.length_capped():  # its last token is already being computed (overlap)
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            target = req.num_computed_tokens + n
            while not self.grow(req, target):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break  # req preempted itself: everyone after it was preempted too
            batch.items.append((req, n))
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # no admissions in a step that had to preempt
        if self.cache is not None and self.waiting:
            self.cache.check_identity()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_tokens = self._map_cached_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.grow(req, req.num_computed_tokens + n):
                if hit_tokens is not None:  # undo the mapping; retried next step
                    self.release(req)
                    req.num_computed_tokens = req.num_registered_pages = 0
                break
            if hit_tokens is not None:
                self.cache.record_query(req.num_tokens, hit_tokens)
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = hit_tokens
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.t_first_scheduled is None:
                req.t_first_scheduled = time.monotonic()
            self.running.append(req)
            batch.items.append((req, n))
            budget -= n
        return batch

    # -- prefix caching ------------------------------------------------------------------------
    def _page_keys(self, req: Request, num_tokens: int) -> list[bytes]:
        """Keys of ``req``'s full pages among its first ``num_tokens`` tokens (computed once per
        page; recomputed if the cache's root changed)."""
        if req.page_keys_root != self.cache.root:
            req.page_keys, req.page_keys_root = [], self.cache.root
        extend_page_keys(req.page_keys, self.cache.root, req.token_slice_bytes, num_tokens,
                         self.page_size)
        return req.page_keys

    def _map_cached_prefix(self, req: Request):
        """Put ``req``'s longest cached full-page prefix on its page table (shared, refcount + 1)
        and mark those tokens computed. Returns the hit in tokens, or None when the request is
        not eligible (caching off, progress already made, or it wants prompt logprobs, which
        need every prompt position computed). The hit never includes the page of the last token:
        one token must be computed for logits, and a request must never write a shared page."""
        if (self.cache is None or req.num_computed_tokens or req.pages or req.num_pending
                or req.wants_prompt_logprobs()):
            return None
        cap = (req.num_tokens - 1) // self.page_size
        keys = self._page_keys(req, cap * self.page_size)
        hit = self.cache.lookup(keys[:cap])
        if hit:
            self.cache.share(hit)
            req.pages = hit
            req.num_registered_pages = len(hit)
            req.num_computed_tokens = len(hit) * self.page_size
        return req.num_computed_tokens

    def cache_full_pages(self, items) -> None:
        """Register the pages the step just filled (call after ``num_computed_tokens`` moved):
        prompt pages as prefill completes them, decode pages as they fill."""
        if self.cache is None:
            return
        for req, _ in items:
            # NOTE: with overlap scheduling the last computed token may still be a placeholder
            # (sampled on the device, id not read yet): its page is registered a step later
            known = min(req.num_computed_tokens, req.num_tokens - req.num_pending)
            full = min(known // self.page_size, len(req.pages))
            if full <= req.num_registered_pages:
                continue
            keys = self._page_keys(req, full * self.page_size)
            for i in range(req.num_registered_pages, full):
                self.cache.register(req.pages[i], keys[i])
            req.num_registered_pages = full

    def release(self, req: Request) -> None:
        """Return every page ``req`` holds (full and sliding) and its residual slot."""
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if self.sliding is not None:
            self.sliding.free(req.request_id)
        if self.residual is not None:
            self.residual.release(req.request_id)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Mark finished and free its pages at once (also used for aborts)."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.release(req)
        req.status = Status.FINISHED
        req.t_finished = time.monotonic()
        req.finish_reason = reason
        req.stop_reason = stop_reason
