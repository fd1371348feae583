"""PageAllocator and SlidingWindowPages on their own (no model, no tensors): symmetric verbs,
reference counts, double frees refused, every page back at the end, sliding pages released as
the window slides."""

from __future__ import annotations

import random

import pytest

from kvfit.kvcache.allocator import OutOfPages, PageAllocator
from kvfit.kvcache.sliding_pages import FREED, SlidingWindowPages, first_live_position


def test_allocate_free_round_trip_random():
    rng = random.Random(1)
    alloc = PageAllocator(37)
    held: list[list[int]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 6)
            if alloc.can_allocate(n):
                pages = alloc.allocate(n)
                assert len(pages) == n == len(set(pages))
                held.append(pages)
            else:
                with pytest.raises(OutOfPages, match=f"asked for {n} pages"):
                    alloc.allocate(n)
        live = [p for ps in held for p in ps]
        assert len(live) == len(set(live)) == alloc.num_used  # never handed out twice
        assert alloc.num_used + alloc.num_free == 37
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == 37 and alloc.num_used == 0


def test_double_free_and_unknown_pages_refused():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free of page"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([3])  # never allocated
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)


def test_shared_page_returns_after_last_reference():
    alloc = PageAllocator(3)
    (p,) = alloc.allocate(1)
    alloc.share([p])
    alloc.free([p])
    assert alloc.num_free == 2  # still referenced once
    alloc.free([p])
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share([p])


def test_sliding_pages_follow_the_window():
    page, window = 4, 10
    sw = SlidingWindowPages(num_pages=12, page_size=page, window=window)
    assert sw.null_page == 12  # one past the last page id: never handed out
    sw.reserve("a", 0, 7)  # a 7-token prompt
    assert sw.table("a") == [0, 1]
    for pos in range(7, 80):  # decode one token at a time
        sw.reserve("a", pos, pos + 1)
        table = sw.table("a")
        first_live = first_live_position(pos, window) // page
        # every page before the one holding the oldest visible key is released ...
        assert all(p == FREED for p in table[:first_live])
        # ... and every page from it to the current one is live and distinct
        live = table[first_live:]
        assert FREED not in live and len(set(live)) == len(live)
        assert sw.num_used == len(live) <= -(-(window - 1) // page) + 2
    with pytest.raises(ValueError, match="already released"):
        sw.reserve("a", 0, 81)  # recomputing from 0 needs free() first
    sw.free("a")
    assert sw.num_used == 0 and sw.table("a") == []
    sw.free("a")  # freeing an unknown request is a no-op, not an error
    assert sw.num_free == 12


def test_sliding_pages_two_requests_share_the_space():
    sw = SlidingWindowPages(num_pages=6, page_size=2, window=3)
    sw.reserve("a", 0, 6)  # pages for 0..5: 3 pages
    sw.reserve("b", 0, 4)  # 2 pages
    assert sw.num_free == 1
    # b at 3 still sees position 1 (page 0): 2 new pages needed, 1 free, nothing to release
    assert not sw.can_reserve("b", 3, 8)
    # b at 4 sees 2..: page 0 is released first, so 1 free + 1 released = the 2 it needs
    assert sw.can_reserve("b", 4, 8)
    assert not sw.can_reserve("b", 4, 10)
    assert sw.can_reserve("a", 6, 8)  # a query at 6 sees 4..6: pages 0 and 1 are released first
    sw.reserve("a", 6, 8)
    assert sw.table("a")[:2] == [FREED, FREED] and sw.num_used == 4
    assert sw.can_reserve("b", 4, 10)
    sw.reserve("b", 4, 10)
    assert sw.table("b")[0] == FREED and sw.num_used == 6
    sw.free("a")
    sw.free("b")
    assert sw.num_free == 6
