"""The page decision: from a byte budget (or the ``--num-pages``/``--num-tokens`` overrides) to the
pages a pool allocates, and the start-up capacity line that says it in user units.

Beside the price list (``kvcache/spec.py``): every byte counted here is priced there. Pools call
these from their ``solve_pages`` class method, so callers (the runner, ``kvfit plan``, the seed
benchmark) size any pool the same way without knowing its type:

* ``size_by_price`` (MHAKVCache, MLAKVCache): every layer keeps every token; pages =
  budget // (page_size x bytes per token).
* ``solve_hybrid_pages`` (HybridSWAKVCache): full layers priced per token, sliding layers per
  *running request*: enough pages for ``max_num_seqs`` requests at the window plus a
  ``max_num_batched_tokens`` step, capped at half the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvfit.errors import KVBudgetError
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.spec import (KVLayerSpec, pages_for, solve_num_pages,
                                spec_kv_bytes_per_token)

GiB = 1 << 30


@dataclass(frozen=True)
class SizingLimits:
    """What bounds a pool: a byte budget, or pages/tokens fixed by flags; and the scheduler's
    limits (a hybrid pool reserves sliding pages per running request, the int4 pool one
    full-precision residual page in ``compute_dtype`` per running request)."""

    budget_bytes: Optional[int] = None
    num_pages: Optional[int] = None
    num_tokens: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    compute_dtype: torch.dtype = torch.bfloat16

    def fixed_pages(self, page_size: int) -> Optional[int]:
        """Pages fixed by ``--num-pages``/``--num-tokens``, None when the budget decides."""
        if self.num_pages is not None:
            return self.num_pages
        if self.num_tokens is not None:
            return pages_for(self.num_tokens, page_size)
        return None


@dataclass(frozen=True)
class PoolSizing:
    """A pool's size: ``num_pages`` pages of ``page_size`` tokens; a token costs
    ``bytes_per_token`` on the layers that keep every token."""

    num_pages: int
    page_size: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def sliding_reservation(self) -> Optional[HybridBudget]:
        """The sliding layers' share of the budget (a ``HybridBudget``), None when every layer
        keeps every token."""
        return None

    def capacity_line(self, fmt: KVFormat, max_model_len: int, tp_size: int = 1,
                      full_layers: Sequence[KVLayerSpec] = ()) -> str:
        """The start-up line: tokens, pages, GiB, format, concurrency at ``max_model_len``.
        Under tensor parallelism (``tp_size`` > 1, this sizing is one rank's pool and
        ``full_layers`` the model's unsharded layers) it also says what each GPU holds, the
        total, and what one GPU with the same budget would hold."""
        conc = self.tokens / max(1, max_model_len)
        tail = (f"max concurrency at {max_model_len:,} tokens/request: {conc:.2f}x")
        if tp_size == 1:
            return (f"KV cache: {self.tokens:,} tokens ({self.num_pages:,} pages x "
                    f"{self.page_size}), {self.pool_bytes / GiB:.2f} GiB, {fmt.name}, "
                    f"{self.bytes_per_token:,} B/token; " + tail)
        return tp_capacity_line(self, fmt, tp_size, full_layers) + "; " + tail


def tp_capacity_line(sizing: PoolSizing, fmt: KVFormat, tp_size: int,
                     full_layers: Sequence[KVLayerSpec]) -> str:
    """Per-GPU and total KV of a tensor-parallel pool: every GPU holds the same tokens, each
    for its share of the KV heads, so the engine's tokens are those of one GPU's pool."""
    if any(l.kind == "mla" for l in full_layers):
        return (f"KV cache: {sizing.tokens:,} tokens over {tp_size} GPUs ({sizing.num_pages:,} "
                f"pages x {sizing.page_size} on each GPU); MLA's latent is shared by all heads, "
                f"so every GPU keeps the whole latent cache of every token: per GPU "
                f"{sizing.pool_bytes / GiB:.2f} GiB, {sizing.bytes_per_token:,} B/token, the "
                f"same tokens as one GPU with the same budget (1.00x: tensor parallelism splits "
                f"MLA's heads and weights, not its KV cache); total "
                f"{tp_size * sizing.pool_bytes / GiB:.2f} GiB, {fmt.name}")
    whole = spec_kv_bytes_per_token(full_layers, fmt) if full_layers else 0
    one_gpu = (sizing.pool_bytes // (whole * sizing.page_size)) * sizing.page_size if whole else 0
    heads_here = {l.num_kv_heads for l in full_layers}
    return (f"KV cache: {sizing.tokens:,} tokens over {tp_size} GPUs ({sizing.num_pages:,} pages "
            f"x {sizing.page_size} on each GPU, each holding its share of the KV heads for all "
            f"{sizing.tokens:,} tokens); per GPU {sizing.pool_bytes / GiB:.2f} GiB, "
            f"{sizing.bytes_per_token:,} B/token; total {tp_size * sizing.pool_bytes / GiB:.2f} "
            f"GiB, {fmt.name}; one GPU with the same budget and all "
            f"{'/'.join(map(str, sorted(heads_here)))} KV heads would hold {one_gpu:,} tokens "
            f"({sizing.tokens / one_gpu if one_gpu else 0:.2f}x)")


def size_by_price(layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                  limits: SizingLimits) -> PoolSizing:
    """Pages from the override flags if given, else the most the byte budget holds."""
    bpt = spec_kv_bytes_per_token(layers, fmt)
    pages = limits.fixed_pages(page_size)
    if pages is None:
        if limits.budget_bytes is None:
            raise ValueError("size_by_price needs budget_bytes, num_pages or num_tokens")
        pages = solve_num_pages(limits.budget_bytes, layers, fmt, page_size)
        if pages < 1:
            raise KVBudgetError(
                f"the KV budget of {limits.budget_bytes / GiB:.3f} GiB holds no page of "
                f"{page_size} tokens ({bpt * page_size} bytes); raise --memory-ratio or set "
                f"--num-pages")
    return PoolSizing(pages, page_size, bpt)


# ---------------------------------------------------------------------------------------------
# hybrid models: full layers per token, sliding layers per running request


def sliding_pages_worst_case(window: int, page_size: int, max_num_seqs: int,
                             max_num_batched_tokens: int) -> int:
    """Sliding pages that ``max_num_seqs`` running requests can hold at once.

    A request computing positions [s, s+n) holds [s-W+1, s+n): at most ceil((W-1)/P) + 2 pages
    plus n/P; summed over requests, n adds up to at most max_num_batched_tokens.
    """
    return (max_num_seqs * (pages_for(window - 1, page_size) + 2)
            + pages_for(max_num_batched_tokens, page_size))


def sliding_pages_one_request(window: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Sliding pages one request may need in a step (the least a pool must have)."""
    return sliding_pages_worst_case(window, page_size, 1, max_num_batched_tokens)


def hybrid_pool_bytes(layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                      num_pages: int, num_swa_pages: int) -> int:
    """Bytes of a windowed HybridSWAKVCache (the sliding null page included)."""
    full = spec_kv_bytes_per_token(layers, fmt, kinds=("full",))
    swa = spec_kv_bytes_per_token(layers, fmt, kinds=("sliding",))
    return page_size * (num_pages * full + (num_swa_pages + 1) * swa)


@dataclass(frozen=True)
class HybridBudget(PoolSizing):
    """How a byte budget splits between full layers (``num_pages``, the engine's allocator,
    ``bytes_per_token`` each) and sliding layers (``num_swa_pages``, null page not counted)."""

    num_swa_pages: int
    window: int
    swa_bytes_per_token: int
    num_full_layers: int
    num_sliding_layers: int

    @property
    def full_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def swa_bytes(self) -> int:
        return (self.num_swa_pages + 1) * self.page_size * self.swa_bytes_per_token

    @property
    def pool_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes

    @property
    def sliding_reservation(self) -> HybridBudget:
        return self

    @property
    def window_requests(self) -> int:
        """Requests decoding past the window that the sliding pages hold at once."""
        return self.num_swa_pages // (pages_for(self.window - 1, self.page_size) + 2)

    def capacity_line(self, fmt: KVFormat, max_model_len: int, tp_size: int = 1,
                      full_layers: Sequence[KVLayerSpec] = ()) -> str:
        """What the full layers hold, what the windows cost; under tensor parallelism
        (``tp_size`` > 1: this is one rank's pool, each rank the same pages for its share of
        the KV heads) also the total over the GPUs."""
        conc = self.tokens / max(1, max_model_len)
        tp = ""
        if tp_size > 1:
            here = self.bytes_per_token + self.swa_bytes_per_token
            whole = spec_kv_bytes_per_token(full_layers, fmt) if full_layers else here
            tp = (f"; tensor parallel over {tp_size} GPUs: the figures above are per GPU, each "
                  f"holding {here / whole:.0%} of every token's KV (its share of the KV heads), "
                  f"total {tp_size * self.pool_bytes / GiB:.2f} GiB")
        return (f"KV cache: {self.tokens:,} tokens ({self.num_pages:,} pages x "
                f"{self.page_size}) on {self.num_full_layers} full layers, "
                f"{self.full_bytes / GiB:.2f} GiB, {self.bytes_per_token:,} B/token; "
                f"{self.num_sliding_layers} sliding layers (window {self.window}): "
                f"{self.num_swa_pages:,} pages reserved (~{self.window_requests} requests at the "
                f"window), {self.swa_bytes / GiB:.2f} GiB, {self.swa_bytes_per_token:,} B/token; "
                f"{fmt.name}; max concurrency at {max_model_len:,} tokens/request: {conc:.2f}x"
                + tp)


def solve_hybrid_pages(budget_bytes: int, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                       page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                       num_pages: int | None = None,
                       max_sliding_fraction: float = 0.5) -> HybridBudget:
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
    windows = [l.window for l in layers if l.kind == "sliding"]
    if not windows:
        raise ValueError("solve_hybrid_pages needs sliding layers; use size_by_price")
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
                f"the KV budget of {budget_bytes / GiB:.3f} GiB cannot hold one request's "
                f"sliding-window pages ({least} pages of {page_size} tokens for window {window} + "
                f"a {max_num_batched_tokens}-token step) plus one full page: "
                f"{need / GiB:.3f} GiB needed; lower --max-num-batched-tokens or raise the "
                f"budget (--memory-ratio, --cpu-kv-space-gib)")
        if full_bpt:
            num_pages = rest // (full_bpt * page_size)
        else:
            num_pages = max_num_seqs * pages_for(max(window, max_num_batched_tokens), page_size)
    kinds = [l.kind for l in layers]
    return HybridBudget(num_pages, page_size, full_bpt, swa_pages, window, swa_bpt,
                        kinds.count("full"), kinds.count("sliding"))
