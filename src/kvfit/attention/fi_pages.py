"""A step's page lists in FlashInfer's CSR form, shared by the fi backend's MHA and MLA halves."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvfit.attention.base import AttentionMetadata


class PageLists(NamedTuple):
    """``indptr`` [B+1], ``last_page_len`` [B], ``kv_len`` [B] and ``qo_indptr`` [B+1] are host
    int32 tensors; ``indices`` (the used block-table entries, request after request) is on the
    block table's device."""
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_len: torch.Tensor
    qo_indptr: torch.Tensor


def page_lists(meta: AttentionMetadata, page_size: int) -> PageLists:
    """The step's lists from the metadata's host copies plus one device gather of the block
    table (no device->host sync)."""
    n = meta.num_pages_cpu
    width = meta.block_table.shape[1]
    indptr = torch.zeros(len(n) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(n, dtype=torch.int32), 0)
    used = torch.arange(width)[None, :] < torch.tensor(n)[:, None]  # [B, width] host
    gather = used.reshape(-1).nonzero().squeeze(1).to(meta.block_table.device, non_blocking=True)
    indices = meta.block_table.reshape(-1)[gather]
    last = torch.tensor([kv - (k - 1) * page_size if k else 0
                         for kv, k in zip(meta.kv_lens_cpu, n)], dtype=torch.int32)
    qo = torch.zeros(len(n) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(meta.q_lens_cpu, dtype=torch.int32), 0)
    return PageLists(indptr, indices, last, torch.tensor(meta.kv_lens_cpu, dtype=torch.int32),
                     qo)
