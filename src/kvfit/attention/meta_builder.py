"""Build ``AttentionMetadata`` for a step from host-side lists (the runner and tests use this).

``build_step_metadata(pool, ...)`` is what the engine calls: plain tables for every pool, plus
the sliding layers' tables (``SlidingTables``) when the pool keeps them in a page space of their
own (``pool.sliding_pages``, kvcache/sliding_pages.py).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from kvfit.attention.base import AttentionMetadata, SlidingTables
from kvfit.kvcache.pool import KVPool
from kvfit.kvcache.sliding_pages import FREED, first_live_position
from kvfit.kvcache.spec import pages_for


def build_metadata(q_lens: Sequence[int], kv_lens: Sequence[int],
                   page_tables: Sequence[Sequence[int]], page_size: int,
                   device: torch.device, max_pages: int | None = None,
                   num_real_reqs: int | None = None) -> AttentionMetadata:
    """q_lens[i] new tokens of request i sit at positions kv_lens[i]-q_lens[i] .. kv_lens[i]-1;
    page_tables[i] lists its pages (at least ceil(kv_lens[i] / page_size) of them).

    Requests with q_len 0 are allowed only as padding. Slots of padded requests (index >=
    num_real_reqs) are -1 so nothing is stored for them.
    """
    b = len(q_lens)
    real = b if num_real_reqs is None else num_real_reqs
    n_pages = [-(-kv // page_size) for kv in kv_lens]
    width = max(max(n_pages, default=1), 1) if max_pages is None else max_pages
    table = torch.zeros((b, width), dtype=torch.int32)
    slots: list[int] = []
    for i, (ql, kv, pages) in enumerate(zip(q_lens, kv_lens, page_tables)):
        if len(pages) < n_pages[i]:
            raise ValueError(f"request {i} has {len(pages)} pages for {kv} tokens")
        if n_pages[i]:
            table[i, : n_pages[i]] = torch.tensor(list(pages[: n_pages[i]]), dtype=torch.int32)
        if i >= real:
            slots.extend([-1] * ql)
            continue
        for pos in range(kv - ql, kv):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(q_lens), dtype=torch.int32), 0)
    return AttentionMetadata(
        cu_seqlens_q=cu.to(device),
        kv_lens=torch.tensor(list(kv_lens), dtype=torch.int32).to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        q_lens_cpu=list(q_lens),
        kv_lens_cpu=list(kv_lens),
        num_pages_cpu=n_pages,
        is_decode=all(q == 1 for q in q_lens),
        num_real_reqs=num_real_reqs,
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


def build_step_metadata(pool: KVPool, q_lens: Sequence[int], kv_lens: Sequence[int],
                        page_tables: Sequence[Sequence[int]], request_ids: Sequence[str],
                        device: torch.device) -> AttentionMetadata:
    """The step's metadata for ``pool``: the sliding layers' tables come from
    ``pool.sliding_pages`` when the pool has one (looked up by request id), else none."""
    sliding = pool.sliding_pages
    if sliding is None:
        return build_metadata(q_lens, kv_lens, page_tables, pool.page_size, device)
    swa_tables = [sliding.table(rid) for rid in request_ids]
    return build_hybrid_metadata(q_lens, kv_lens, page_tables, swa_tables, pool.page_size,
                                 sliding.window, sliding.null_page, device)
