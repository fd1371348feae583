"""HybridSWAKVCache: a pool for models that mix full-attention and sliding-window layers (Gemma 2/3,
Mistral-style windows), where the windowed layers keep only the last ``window`` tokens per request.

Two page spaces
---------------
Full layers and sliding layers live in separate page spaces of the same ``page_size``:

* full layers: ``k_caches[l]``/``v_caches[l]`` are ``[num_pages, H, P, D]``; a request's pages come
  from the engine's ``PageAllocator`` exactly as for ``MHAKVCache`` (every token keeps its slot).
* sliding layers: ``[num_swa_pages + 1, H, P, D]``; pages come from ``pool.sliding_pages``
  (a ``SlidingWindowPages``: its own allocator plus one *logical* page list per request). The
  extra page ``null_page = num_swa_pages`` is zero-filled and never handed out.

Holes in the sliding page lists
-------------------------------
A request's sliding page list is indexed by *logical* page (page j holds positions
``j*P .. j*P+P-1``), like the full one. When decoding moves on, pages whose every token lies before
``num_computed - window + 1`` can never be attended again (queries only move forward): they go back
to the allocator and their entry in the list becomes ``-1``. So a long request holds about
``window / P + 2`` sliding pages, whatever its length. In the step metadata
(``build_hybrid_metadata``) the ``-1`` entries are written as ``null_page``, so the sliding block
table stays logically indexed and dense: GPU kernels that apply the window mask never read a
freed page's (reused) contents, they read at most the finite zeros of the null page, masked out.
The torch reference gathers only the live window (from ``SlidingTables.first_live_cpu``) and
passes the absolute position of its first key to ``attend``.

KV dtypes: every format of kvcache/dtypes.py, per-layer K and V scales; the store is the
saturating ``quantize`` (fp8 never stores NaN/Inf). Tested tolerances: stored elements within
2^-4 (e4m3) / 2^-3 (e5m2) relative (+ one subnormal step x scale) of the clamped input; tiny
random Gemma logits within 5% / 10% of the bf16-cache logits' scale; real Gemma-3-270M top-1
agreement with the float32 cache >= 0.9 (e4m3) past the window (tests/test_swa_pool.py,
tests/test_gemma3.py).

Two modes, fixed at construction
--------------------------------
* windowed (``num_swa_pages`` given; what the engine should use): as above. Backends must read
  the sliding layers' tables from ``meta.swa`` (``HybridAttentionMetadata``); plain metadata is
  refused with an error (never a silent read of the wrong page space).
* shared (``num_swa_pages=None``; throwaway pools for activation profiling and scale calibration,
  or an engine whose scheduler does not drive ``sliding_pages`` yet): sliding layers use the full
  layers' page ids (tensors ``[num_pages, ...]``), nothing is released, the window is applied as a
  mask only, and the price is MHAKVCache's. ``sliding_pages`` is None.

Price list: a token costs ``spec_kv_bytes_per_token(layers, fmt, kinds=("full",))`` on the full
layers; the sliding layers are priced per *running request* (``solve_hybrid_pages``): enough
pages for ``max_num_seqs`` requests at the window plus a ``max_num_batched_tokens`` step, capped
at half the budget; the scheduler treats sliding pages as a second resource
(``can_reserve``/``reserve``/``free``, like ``PageAllocator``'s verbs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.attention.meta_builder import build_metadata
from kvfit.kvcache.allocator import OutOfPages, PageAllocator
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.pool import KVPool, MHAKVCache
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token

FREED = -1  # entry of a sliding page list whose page fell out of the window


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_live_position(start: int, window: int) -> int:
    """The earliest position a query at ``start`` (or later) can still attend."""
    return max(0, start - window + 1)


class SlidingWindowPages:
    """Host-side page lists of the sliding-window layers (never touches tensors).

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
        return max(0, _cdiv(end, self.page_size) - len(table))

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
        need = _cdiv(end, self.page_size) - len(table)
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


class HybridSWAKVCache(KVPool):
    """K/V for full layers (every token) and sliding layers (last ``window`` tokens per request).

    Owns its tensors, its per-layer scales and ``sliding_pages`` (see the module docstring).
    ``store_kv``/``gather_kv`` take slots/pages of the layer's own page space: the backend picks
    ``meta.swa`` for sliding layers (``HybridAttentionMetadata``) and the plain tables otherwise.
    """

    name = "HybridSWAKVCache"
    layer_kinds = frozenset({"full", "sliding"})
    prefix_caching_refusal = ("its sliding-window layers give pages back as the window slides, "
                              "so a finished prompt's early window pages are gone")

    def __init__(self, layers: Sequence[KVLayerSpec], num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device, k_scales=None, v_scales=None,
                 num_swa_pages: Optional[int] = None):
        super().__init__(layers, num_pages, page_size, fmt, device, k_scales, v_scales)
        windows = {l.window for l in self.layers if l.kind == "sliding"}
        if not windows or None in windows:
            raise ValueError("HybridSWAKVCache needs sliding layers with a window; use MHAKVCache")
        if num_swa_pages is not None and num_swa_pages < 1:
            raise ValueError("num_swa_pages must be >= 1 (see solve_hybrid_pages), or None for "
                             "the shared mode")
        self.window = max(windows)
        self.num_swa_pages = num_swa_pages
        self.null_page = num_swa_pages
        self.sliding_pages: Optional[SlidingWindowPages] = None
        if num_swa_pages is not None:
            self.sliding_pages = SlidingWindowPages(num_swa_pages, page_size, self.window)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for spec in self.layers:
            if spec.kind == "full" or num_swa_pages is None:
                shape = (num_pages, spec.num_kv_heads, page_size, spec.head_dim)
                make = torch.empty
            else:  # sliding: zeros so that the null page reads finite
                shape = (num_swa_pages + 1, spec.num_kv_heads, page_size, spec.head_dim)
                make = torch.zeros
            self.k_caches.append(make(shape, dtype=self.dtype, device=device))
            self.v_caches.append(make(shape, dtype=self.dtype, device=device))

    @property
    def windowed(self) -> bool:
        """True when sliding layers have their own page space (``meta.swa`` required)."""
        return self.sliding_pages is not None

    def priced_bytes(self) -> int:
        if not self.windowed:
            return super().priced_bytes()
        return hybrid_pool_bytes(self.layers, self.fmt, self.page_size, self.num_pages,
                                 self.num_swa_pages)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches))

    # same per-layer tensor layout as MHAKVCache: reuse its store and gather
    store_kv = MHAKVCache.store_kv
    gather_kv = MHAKVCache.gather_kv


@dataclass
class SlidingTables:
    """The sliding layers' view of a step: same shapes as the plain fields of AttentionMetadata.

    block_table [B, max_pages] int32 (logical pages; freed ones = the pool's null page),
    slot_mapping [T] int64 (slots in the sliding page space), num_pages_cpu (logical pages),
    first_live_cpu (first logical page each request's queries can see).
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_pages_cpu: list[int]
    first_live_cpu: list[int]


@dataclass
class HybridAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus the sliding layers' tables (``swa``)."""

    swa: Optional[SlidingTables] = None


def build_hybrid_metadata(q_lens: Sequence[int], kv_lens: Sequence[int],
                          page_tables: Sequence[Sequence[int]],
                          swa_tables: Sequence[Sequence[int]], page_size: int, window: int,
                          null_page: int, device: torch.device, max_pages: int | None = None,
                          num_real_reqs: int | None = None) -> HybridAttentionMetadata:
    """``build_metadata`` for the full layers plus ``SlidingTables`` built from ``swa_tables``
    (each a ``SlidingWindowPages.table``). Raises if a page the step must read or write was freed.
    """
    base = build_metadata(q_lens, kv_lens, page_tables, page_size, device, max_pages,
                          num_real_reqs)
    real = len(q_lens) if num_real_reqs is None else num_real_reqs
    mapped, first_live = [], []
    for i, (ql, kv, table) in enumerate(zip(q_lens, kv_lens, swa_tables)):
        first = first_live_position(kv - ql, window) // page_size
        need = _cdiv(kv, page_size)
        if i < real and any(p == FREED for p in table[first:need]):
            raise ValueError(f"request {i}: sliding page list {list(table[:need])} has freed "
                             f"pages inside its window (positions {kv - ql}..{kv - 1})")
        mapped.append([null_page if p == FREED else p for p in table])
        first_live.append(first)
    swa = build_metadata(q_lens, kv_lens, mapped, page_size, device, max_pages, num_real_reqs)
    return HybridAttentionMetadata(
        **{f.name: getattr(base, f.name) for f in fields(AttentionMetadata)},
        swa=SlidingTables(swa.block_table, swa.slot_mapping, swa.num_pages_cpu, first_live))


# ---------------------------------------------------------------------------------------------
# price list for hybrid models


def sliding_pages_worst_case(window: int, page_size: int, max_num_seqs: int,
                             max_num_batched_tokens: int) -> int:
    """Sliding pages that ``max_num_seqs`` running requests can hold at once.

    A request computing positions [s, s+n) holds [s-W+1, s+n): at most ceil((W-1)/P) + 2 pages
    plus n/P; summed over requests, n adds up to at most max_num_batched_tokens.
    """
    return (max_num_seqs * (_cdiv(window - 1, page_size) + 2)
            + _cdiv(max_num_batched_tokens, page_size))


def hybrid_pool_bytes(layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                      num_pages: int, num_swa_pages: int) -> int:
    """Bytes of a HybridSWAKVCache (the sliding null page included)."""
    full = spec_kv_bytes_per_token(layers, fmt, kinds=("full",))
    swa = spec_kv_bytes_per_token(layers, fmt, kinds=("sliding",))
    return page_size * (num_pages * full + (num_swa_pages + 1) * swa)


@dataclass(frozen=True)
class HybridPlan:
    """How a byte budget splits between full layers and sliding layers."""

    num_pages: int  # full-layer pages (the engine's PageAllocator)
    num_swa_pages: int  # sliding-layer pages (pool.sliding_pages), null page not counted
    page_size: int
    window: int
    full_bytes_per_token: int
    swa_bytes_per_token: int
    num_full_layers: int
    num_sliding_layers: int

    @property
    def full_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def full_bytes(self) -> int:
        return self.full_tokens * self.full_bytes_per_token

    @property
    def swa_bytes(self) -> int:
        return (self.num_swa_pages + 1) * self.page_size * self.swa_bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    @property
    def window_requests(self) -> int:
        """Requests decoding past the window that the sliding pages hold at once."""
        return self.num_swa_pages // (_cdiv(self.window - 1, self.page_size) + 2)


def sliding_pages_one_request(window: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Sliding pages one request may need in a step (the least a pool must have)."""
    return sliding_pages_worst_case(window, page_size, 1, max_num_batched_tokens)


def solve_hybrid_pages(budget_bytes: int, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                       page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                       num_pages: int | None = None,
                       max_sliding_fraction: float = 0.5) -> HybridPlan:
    """Split a byte budget: sliding pages first, the rest to full-layer pages.

    Sliding pages: the worst case of ``max_num_seqs`` running requests
    (``sliding_pages_worst_case``), capped at ``max_sliding_fraction`` of the budget but never
    below what one request needs. When capped, fewer requests run at once: the scheduler checks
    ``SlidingWindowPages.can_reserve`` like ``PageAllocator.can_allocate`` (admission and
    preemption). ``num_pages`` (from ``--num-pages``/``--num-tokens``) fixes the full pages and
    reserves the uncapped worst case. A model without full layers gets token bookkeeping pages
    that cost no bytes. Raises ``KVBudgetError`` when the budget cannot hold one request's
    sliding pages plus one full page, naming the flags that help.
    """
    from kvfit.errors import KVBudgetError

    windows = [l.window for l in layers if l.kind == "sliding"]
    if not windows:
        raise ValueError("solve_hybrid_pages needs sliding layers; use solve_num_pages")
    window = max(windows)
    full_bpt = spec_kv_bytes_per_token(layers, fmt, kinds=("full",))
    swa_bpt = spec_kv_bytes_per_token(layers, fmt, kinds=("sliding",))
    swa_pages = sliding_pages_worst_case(window, page_size, max_num_seqs, max_num_batched_tokens)
    if num_pages is None:
        least = sliding_pages_one_request(window, page_size, max_num_batched_tokens)
        cap = int(budget_bytes * max_sliding_fraction) // (page_size * swa_bpt) - 1
        swa_pages = min(swa_pages, max(cap, least))
        rest = budget_bytes - (swa_pages + 1) * page_size * swa_bpt
        if rest < 0 or (full_bpt and rest < full_bpt * page_size):
            need = (least + 1) * page_size * swa_bpt + full_bpt * page_size
            raise KVBudgetError(
                f"the KV budget of {budget_bytes / 2**30:.3f} GiB cannot hold one request's "
                f"sliding-window pages ({least} pages of {page_size} tokens for window {window} + "
                f"a {max_num_batched_tokens}-token step) plus one full page: "
                f"{need / 2**30:.3f} GiB needed; lower --max-num-batched-tokens or raise the "
                f"budget (--memory-ratio, --cpu-kv-space-gib)")
        if full_bpt:
            num_pages = rest // (full_bpt * page_size)
        else:
            num_pages = max_num_seqs * _cdiv(max(window, max_num_batched_tokens), page_size)
    kinds = [l.kind for l in layers]
    return HybridPlan(num_pages, swa_pages, page_size, window, full_bpt, swa_bpt,
                      kinds.count("full"), kinds.count("sliding"))


def hybrid_capacity_line(plan: HybridPlan, fmt: KVFormat, max_model_len: int) -> str:
    """The start-up line for a hybrid pool: what the full layers hold, what the windows cost."""
    gib = 2 ** 30
    conc = plan.full_tokens / max(1, max_model_len)
    return (f"KV cache: {plan.full_tokens:,} tokens ({plan.num_pages:,} pages x {plan.page_size}) "
            f"on {plan.num_full_layers} full layers, {plan.full_bytes / gib:.2f} GiB, "
            f"{plan.full_bytes_per_token:,} B/token; {plan.num_sliding_layers} sliding layers "
            f"(window {plan.window}): {plan.num_swa_pages:,} pages reserved "
            f"(~{plan.window_requests} requests at the window), {plan.swa_bytes / gib:.2f} GiB, "
            f"{plan.swa_bytes_per_token:,} B/token; {fmt.name}; "
            f"max concurrency at {max_model_len:,} tokens/request: {conc:.2f}x")
