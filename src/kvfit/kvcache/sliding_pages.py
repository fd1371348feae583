"""SlidingWindowPages: the per-request page lists of sliding-window layers, beside the allocator.

Pure host bookkeeping (never touches a tensor), like ``PageAllocator``. A windowed
``HybridSWAKVCache`` keeps its sliding layers in a page space of their own; this class decides
which of those pages each request holds.

A request's list is indexed by *logical* page (page j holds positions ``j*P .. j*P+P-1``), like the
full-layer page list. When decoding moves on, pages whose every token lies before
``num_computed - window + 1`` can never be attended again (queries only move forward): they go
back to the allocator and their entry becomes ``FREED`` (-1). So a long request holds about
``window / P + 2`` sliding pages, whatever its length. The step metadata
(``attention/meta_builder.build_hybrid_metadata``) writes ``FREED`` entries as ``null_page`` (the
one page id never handed out, zero-filled by the pool).
"""

from __future__ import annotations

from kvfit.kvcache.allocator import OutOfPages, PageAllocator
from kvfit.kvcache.spec import pages_for

FREED = -1  # entry of a sliding page list whose page fell out of the window


def first_live_position(start: int, window: int) -> int:
    """The earliest position a query at ``start`` (or later) can still attend."""
    return max(0, start - window + 1)


class SlidingWindowPages:
    """Host-side page lists of the sliding-window layers.

    Mutates its allocator and its per-request lists. The scheduler calls, per request:
    ``can_reserve(rid, start, end)`` (admission / preemption check), ``reserve(rid, start, end)``
    before a step that computes positions ``[start, end)`` (frees what fell out of the window,
    then allocates up to ``end``; ``OutOfPages`` if it cannot), optionally
    ``release(rid, num_computed)`` after the step (returns pages early), and ``free(rid)`` when
    the request finishes, aborts or is preempted.
    """

    def __init__(self, num_pages: int, page_size: int, window: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.window = window
        self.null_page = num_pages  # never handed out: the pool keeps it zero-filled
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def table(self, rid: str) -> list[int]:
        """The request's logical page list (``FREED`` = -1 where a page fell out of the window)."""
        return self.tables.get(rid, [])

    def pages_needed(self, rid: str, start: int, end: int) -> int:
        """New pages ``reserve(rid, start, end)`` would take (after its releases)."""
        table = self.tables.get(rid, [])
        return max(0, pages_for(end, self.page_size) - len(table))

    def can_reserve(self, rid: str, start: int, end: int) -> bool:
        """Whether ``reserve(rid, start, end)`` succeeds (counting the pages it releases first).
        The scheduler's admission/preemption check, like ``PageAllocator.can_allocate``."""
        table = self.tables.get(rid, [])
        dead = min(first_live_position(start, self.window) // self.page_size, len(table))
        releasable = sum(1 for p in table[:dead] if p != FREED)
        return self.pages_needed(rid, start, end) <= self.allocator.num_free + releasable

    def release(self, rid: str, num_computed: int) -> int:
        """Free the pages no query at position >= ``num_computed`` can see; returns how many."""
        table = self.tables.get(rid)
        if not table:
            return 0
        dead = min(first_live_position(num_computed, self.window) // self.page_size, len(table))
        freed = [p for p in table[:dead] if p != FREED]
        if freed:
            self.allocator.free(freed)
            table[:dead] = [FREED] * dead
        return len(freed)

    def reserve(self, rid: str, start: int, end: int) -> None:
        """Make positions ``[start, end)`` storable and ``[start - window + 1, end)`` readable."""
        table = self.tables.setdefault(rid, [])
        if start < len(table) * self.page_size and any(
                p == FREED for p in table[start // self.page_size:]):
            raise ValueError(f"request {rid}: positions from {start} were already released; "
                             f"free() it before recomputing")
        self.release(rid, start)
        need = pages_for(end, self.page_size) - len(table)
        if need > 0:
            if not self.allocator.can_allocate(need):
                raise OutOfPages(f"sliding-window pages exhausted: request {rid} needs {need}, "
                                 f"{self.allocator.num_free} free (check can_reserve first)")
            table.extend(self.allocator.allocate(need))

    def free(self, rid: str) -> None:
        """Return all of the request's live pages (finish, abort, preemption)."""
        table = self.tables.pop(rid, None)
        if table:
            live = [p for p in table if p != FREED]
            if live:
                self.allocator.free(live)
