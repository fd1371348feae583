"""Build ``AttentionMetadata`` for a step from host-side lists (the runner and tests use this)."""

from __future__ import annotations

from typing import Sequence

import torch

from kvfit.attention.base import AttentionMetadata


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
