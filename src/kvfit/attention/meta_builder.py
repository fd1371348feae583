"""Build ``AttentionMetadata`` for a step from host-side lists (the runner and tests use this).

``build_step_metadata(pool, ...)`` is what the engine calls: plain tables for every pool, plus
the sliding layers' tables (``SlidingTables``) when the pool keeps them in a page space of their
own (``pool.sliding_pages``, kvcache/sliding_pages.py).

The host arrays are built with numpy (no per-token Python loop) and packed into one int32 buffer
(cu_seqlens_q | kv_lens | block table) and one int64 buffer (slot mapping), so a step costs two
host->device copies, non-blocking from pinned memory on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from kvfit.attention.base import AttentionMetadata, SlidingTables
from kvfit.kvcache.int4_residual import plan_residual_store
from kvfit.kvcache.pool import KVPool
from kvfit.kvcache.sliding_pages import FREED, first_live_position
from kvfit.kvcache.spec import pages_for
from kvfit.transfer import to_device


def page_table_array(page_tables: Sequence[Sequence[int]], n_pages: np.ndarray,
                     width: int) -> np.ndarray:
    """[B, width] int32: row i holds the first ``n_pages[i]`` pages of request i, zero-padded."""
    b = len(page_tables)
    table = np.zeros((b, width), dtype=np.int32)
    have = np.fromiter(map(len, page_tables), dtype=np.int64, count=b)
    short = np.nonzero(have < n_pages)[0]
    if len(short):
        i = int(short[0])
        raise ValueError(f"request {i} has {have[i]} pages for {n_pages[i]} pages of tokens")
    # one flat conversion of every needed page id, then a masked scatter into the rows
    flat: list[int] = []
    for pages, k in zip(page_tables, n_pages.tolist()):
        flat += pages[:k]
    table[np.arange(width) < n_pages[:, None]] = flat  # row-major: request i's pages in order
    return table


def token_request_index(q_lens: np.ndarray) -> np.ndarray:
    """[T] int64: the request each token of the flat batch belongs to."""
    return np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)


def token_positions(q_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """[T] int64: absolute position of each new token (request i's sit at kv-q .. kv-1)."""
    q = q_lens.astype(np.int64)
    starts = np.cumsum(q) - q  # flat offset of each request's first token
    req = token_request_index(q)
    return np.arange(int(q.sum()), dtype=np.int64) - starts[req] + (kv_lens - q)[req]


def build_metadata(q_lens: Sequence[int], kv_lens: Sequence[int],
                   page_tables: Sequence[Sequence[int]], page_size: int,
                   device: torch.device, max_pages: int | None = None,
                   num_real_reqs: int | None = None,
                   residual_slots: Sequence[int] | None = None) -> AttentionMetadata:
    """q_lens[i] new tokens of request i sit at positions kv_lens[i]-q_lens[i] .. kv_lens[i]-1;
    page_tables[i] lists its pages (at least ceil(kv_lens[i] / page_size) of them).

    Requests with q_len 0 are allowed only as padding. Slots of padded requests (index >=
    num_real_reqs) are -1 so nothing is stored for them. ``residual_slots`` (int4 pool): each
    request's residual slot, which adds the step's store plan (``meta.residual``).
    """
    b = len(q_lens)
    real = b if num_real_reqs is None else num_real_reqs
    q = np.asarray(q_lens, dtype=np.int64).reshape(b)
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(b)
    n_pages = -(-kv // page_size)
    width = max(int(n_pages.max(initial=1)), 1) if max_pages is None else max_pages
    table = page_table_array(page_tables, n_pages, width)  # [B, width]
    req = token_request_index(q)  # [T]
    pos = token_positions(q, kv)  # [T]
    slots = table[req, pos // page_size].astype(np.int64) * page_size + pos % page_size
    slots[req >= real] = -1  # padded requests store nothing
    ints = np.empty(b + 1 + b + b * width, dtype=np.int32)  # cu_seqlens | kv_lens | table
    ints[0] = 0
    ints[1:b + 1] = np.cumsum(q)
    ints[b + 1:2 * b + 1] = kv
    ints[2 * b + 1:] = table.reshape(-1)
    dev_ints = to_device(ints, device)
    residual = None
    if residual_slots is not None:
        live = [s if i < real else -1 for i, s in enumerate(residual_slots)]
        residual = plan_residual_store(q_lens, kv_lens, page_tables, live, page_size, device)
    return AttentionMetadata(
        cu_seqlens_q=dev_ints[: b + 1],
        kv_lens=dev_ints[b + 1: 2 * b + 1],
        block_table=dev_ints[2 * b + 1:].view(b, width),
        slot_mapping=to_device(slots, device),
        q_lens_cpu=[int(x) for x in q_lens],
        kv_lens_cpu=[int(x) for x in kv_lens],
        num_pages_cpu=n_pages.tolist(),
        is_decode=all(x == 1 for x in q_lens),
        num_real_reqs=num_real_reqs,
        residual=residual,
    )


def build_hybrid_metadata(q_lens: Sequence[int], kv_lens: Sequence[int],
                          page_tables: Sequence[Sequence[int]],
                          swa_tables: Sequence[Sequence[int]], page_size: int, window: int,
                          null_page: int, device: torch.device, max_pages: int | None = None,
                          num_real_reqs: int | None = None) -> AttentionMetadata:
    """``build_metadata`` for the full layers plus ``meta.swa`` built from ``swa_tables`` (each a
    ``SlidingWindowPages.table``; ``FREED`` entries become ``null_page``). Raises if a page the
    step must read or write was freed.
    """
    base = build_metadata(q_lens, kv_lens, page_tables, page_size, device, max_pages,
                          num_real_reqs)
    real = len(q_lens) if num_real_reqs is None else num_real_reqs
    mapped, first_live = [], []
    for i, (ql, kv, table) in enumerate(zip(q_lens, kv_lens, swa_tables)):
        first = first_live_position(kv - ql, window) // page_size
        need = pages_for(kv, page_size)
        if i < real and any(p == FREED for p in table[first:need]):
            raise ValueError(f"request {i}: sliding page list {list(table[:need])} has freed "
                             f"pages inside its window (positions {kv - ql}..{kv - 1})")
        mapped.append([null_page if p == FREED else p for p in table])
        first_live.append(first)
    swa = build_metadata(q_lens, kv_lens, mapped, page_size, device, max_pages, num_real_reqs)
    return dataclasses.replace(base, swa=SlidingTables(swa.block_table, swa.slot_mapping,
                                                       swa.num_pages_cpu, first_live))


@dataclasses.dataclass(frozen=True)
class RequestLookups:
    """What a step's metadata reads from the pool's host bookkeeping, per request (batch order):
    the sliding page lists (``SlidingWindowPages.table``, None for pools without a sliding page
    space) and the int4 residual slots (None for other pools). Under tensor parallelism rank 0
    resolves them and sends them in the step message: only its pool's bookkeeping is driven by
    the scheduler."""

    swa_tables: list | None = None
    residual_slots: list | None = None


def request_lookups(pool: KVPool, request_ids: Sequence[str]) -> RequestLookups:
    """``pool``'s per-request bookkeeping for the step's requests (the pool's own lists, not
    copies: valid until the scheduler's next step)."""
    sliding = pool.sliding_pages
    swa = None if sliding is None else [sliding.table(rid) for rid in request_ids]
    slots = (None if pool.residual_slots is None
             else [pool.residual_slots.slot(rid) for rid in request_ids])
    return RequestLookups(swa, slots)


def build_step_metadata(pool: KVPool, q_lens: Sequence[int], kv_lens: Sequence[int],
                        page_tables: Sequence[Sequence[int]], request_ids: Sequence[str],
                        device: torch.device,
                        lookups: RequestLookups | None = None) -> AttentionMetadata:
    """The step's metadata for ``pool``: the sliding layers' tables when the pool has a sliding
    page space, the int4 store plan when it has residual slots. Both come from ``lookups`` when
    given (a tensor-parallel worker: rank 0's, from the step message), else from ``pool``'s own
    bookkeeping by request id (``request_lookups``)."""
    if lookups is None:
        lookups = request_lookups(pool, request_ids)
    sliding = pool.sliding_pages
    if sliding is None:
        return build_metadata(q_lens, kv_lens, page_tables, pool.page_size, device,
                              residual_slots=lookups.residual_slots)
    return build_hybrid_metadata(q_lens, kv_lens, page_tables, lookups.swa_tables,
                                 pool.page_size, sliding.window, sliding.null_page, device)
