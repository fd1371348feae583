"""Automatic prefix caching: full KV pages keyed by a hash chained over every token before them.

Design (vLLM v1's hash-chained full pages, not SGLang's radix tree). A full page's key is
``sha256(parent key || its page_size token ids)``, and the chain starts at a root key derived from
the identity of the KV contents (model, KV format, page size, per-layer K/V scales). Two requests
share page i exactly when their first ``(i + 1) * page_size`` tokens agree and the pool stores
them the same way. Why this and not a radix tree: our pages are the unit of sharing anyway (only
full pages are shared, so a tree would branch only at page boundaries and degenerate into this
chain), a flat ``dict`` lookup per page is O(1) with no tree to rebalance or lock, and eviction is
a plain LRU over pages. A sha256 key makes an accidental collision (and so silently wrong KV)
practically impossible; Python's 64-bit ``hash`` would not.

``PrefixCachingAllocator`` extends ``PageAllocator`` without changing its verbs. The cache itself
holds one reference on every page it maps, so a cached page is never on the free list; a cached
page whose only reference is the cache's is *evictable* and sits in an LRU. ``num_free`` counts
free + evictable pages (what ``allocate`` can hand out), so the scheduler's arithmetic is the same
with caching on or off; ``allocate`` evicts least-recently-freed cached pages only when the plain
free list runs short. Requests map hit pages with ``share`` (refcount + 1) and drop them with
``free`` like any other page.

Invariants the scheduler keeps (see Scheduler.admit_cached_prefix / cache_full_pages):
- only pages whose every slot has been computed are registered (never a page being written);
- a hit never covers the page holding the request's last token (the hit is capped at
  ``num_tokens - 1`` floored to a page boundary), so a request never writes into a shared page
  (the chunked fp8 store in kernels/store.py rewrites whole page rows and relies on this).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from kvfit.kvcache.allocator import PageAllocator

log = logging.getLogger("kvfit")

PageKey = bytes


def kv_identity(model: tuple, pool) -> tuple:
    """What makes two pools' pages interchangeable: the model (its weights and compute dtype, as
    the caller identifies them), KV format, page size, V layout and the per-layer K/V scales (a
    calibration or rotation changes the stored bytes), and the K centering / rotation
    (``pool.kv_transform``)."""
    tf = getattr(pool, "kv_transform", None)
    return (model, pool.fmt.name, pool.page_size, getattr(pool, "v_layout", "HND"),
            tuple(pool.k_scales), tuple(pool.v_scales), None if tf is None else tf.identity())


def root_key(identity: tuple) -> PageKey:
    """The chain's start: a digest of the KV identity (so a format change changes every key)."""
    return hashlib.sha256(repr(identity).encode()).digest()


def page_key(parent: PageKey, tokens: Sequence[int]) -> PageKey:
    """Key of a full page: its parent's key chained with its token ids (int64, native order)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def extend_page_keys(keys: list[PageKey], root: PageKey, token_slice, num_tokens: int,
                     page_size: int) -> None:
    """Append the keys of the full pages among the first ``num_tokens`` tokens that ``keys``
    lacks (the same keys as ``page_key`` chained from ``root``). ``token_slice(start, end)``
    returns the token ids as a list, or as their int64 bytes (``Request.token_slice_bytes``).
    Mutates ``keys``.

    One slice and one conversion for all new pages, then one sha256 per page over a view of the
    bytes: the cached-prefix admission of a 4k-token prompt hashes 128 pages on the engine's
    critical path, where a slice, an ``array`` and a concatenation per page cost ~2x the hash."""
    first, last = len(keys), num_tokens // page_size
    if last <= first:
        return
    data = token_slice(first * page_size, last * page_size)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data = array("q", data).tobytes()
    view = memoryview(data)
    step = page_size * 8  # bytes of one page's int64 ids
    parent = keys[-1] if first else root
    for off in range(0, (last - first) * step, step):
        h = hashlib.sha256(parent)
        h.update(view[off:off + step])
        parent = h.digest()
        keys.append(parent)


class PrefixCachingAllocator(PageAllocator):
    """A PageAllocator whose freed full pages stay cached (evicted LRU) and can be looked up by key.

    Owns: the key <-> page maps, the LRU of evictable pages, the KV identity the keys were made
    under, and the query/hit token counters. Mutates refcounts through the base class only.
    """

    def __init__(self, num_pages: int, identity: Callable[[], tuple]):
        super().__init__(num_pages)
        self._identity_of_pool = identity
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.identity = identity()
        self.root = root_key(self.identity)
        self.num_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hits = 0  # of those, tokens found cached (prefix_cache_hits)
        self.num_evictions = 0

    # -- the allocator's verbs, cache-aware ---------------------------------------------------
    @property
    def num_free(self) -> int:
        return super().num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages that hold a registered prefix (in use or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages, evicting least-recently-freed cached pages when the free list is
        short."""
        short = n - super().num_free
        if short > 0 and short <= len(self._evictable):
            for _ in range(short):
                self._evict_oldest()
        return super().allocate(n)

    def share(self, pages: Iterable[int]) -> None:
        """Add a reference to each page (an evictable cached page becomes in use again)."""
        pages = list(pages)
        for p in pages:
            self._evictable.pop(p, None)
        super().share(pages)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page. A cached page left with only the cache's reference
        becomes evictable; pages are parked in reverse order so a request's tail pages are
        evicted before its prefix (which more requests are likely to share)."""
        pages = list(pages)
        super().free(pages)
        for p in reversed(pages):
            if p in self._key_of and self.ref_count(p) == 1:
                self._evictable[p] = None
                self._evictable.move_to_end(p)

    # -- the cache -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[PageKey]) -> list[int]:
        """Pages of the longest cached prefix of ``keys`` (no reference taken: ``share`` them)."""
        hit = []
        for k in keys:
            p = self._page_of.get(k)
            if p is None:
                break
            hit.append(p)
        return hit

    def register(self, page: int, key: PageKey) -> bool:
        """Cache a full, computed page under ``key`` (the cache takes a reference). False, changing
        nothing, if the page is already cached or another page already holds that key (two
        requests computed the same prefix at once: the first one registered wins)."""
        if page in self._key_of or key in self._page_of:
            return False
        super().share([page])
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def check_identity(self) -> None:
        """Drop every cached page if the pool's KV identity changed since the pages were cached
        (new scales, format, page size): stale pages must never be reused. Pages in use stay with
        their requests but are unmapped; evictable ones go back to the free list."""
        identity = self._identity_of_pool()
        if identity == self.identity:
            return
        log.info("KV identity changed: dropping %d cached prefix pages", len(self._key_of))
        self.identity, self.root = identity, root_key(identity)
        for page in list(self._key_of):
            self._uncache(page)

    def reset(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): evictable pages go back to
        the free list, pages in use stay with their requests, unmapped. Returns the number of
        pages that were cached."""
        n = len(self._key_of)
        for page in list(self._key_of):
            self._uncache(page)
        return n

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def _evict_oldest(self) -> None:
        page, _ = self._evictable.popitem(last=False)
        self.num_evictions += 1
        self._uncache(page)

    def _uncache(self, page: int) -> None:
        self._evictable.pop(page, None)
        key = self._key_of.pop(page)
        del self._page_of[key]
        super().free([page])  # the cache's reference
