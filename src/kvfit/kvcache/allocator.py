"""PageAllocator: which KV pages are free. Pure CPU bookkeeping, never touches the pool tensors.

Symmetric verbs: ``can_allocate(n)`` / ``allocate(n)`` / ``free(pages)``, with reference counts so a
page can later be shared (prefix cache) and is returned to the free list when its count reaches 0.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class OutOfPages(RuntimeError):
    """Raised when more pages are asked for than are free (callers check ``can_allocate`` first)."""


class PageAllocator:
    """Free list + reference counts over ``num_pages`` page ids ``0 .. num_pages-1``."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page: int) -> int:
        """References held on ``page`` (0 = free)."""
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each). Mutates the free list."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add a reference to pages already in use."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching 0 go back to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
