"""attention/fi_pages.page_lists: the CSR page lists the fi backend plans FlashInfer's MHA and MLA
wrappers with, from a step's metadata (CPU: host lists and the block-table gather)."""

from __future__ import annotations

import torch

from kvfit.attention.fi_pages import page_lists
from kvfit.attention.meta_builder import build_metadata


def test_page_lists_of_a_mixed_step():
    page = 16
    q_lens, kv_lens = [37, 1, 20, 1], [37, 50, 83, 16]
    g = torch.Generator().manual_seed(0)
    perm = (torch.randperm(40, generator=g) + 1).tolist()
    tables, i = [], 0
    for n in kv_lens:
        k = -(-n // page)
        tables.append(perm[i:i + k])
        i += k
    meta = build_metadata(q_lens, kv_lens, tables, page, "cpu")
    pl = page_lists(meta, page)
    assert pl.indptr.tolist() == [0, 3, 7, 13, 14]
    assert pl.indices.tolist() == sum(tables, [])  # every used entry, request after request
    assert pl.last_page_len.tolist() == [5, 2, 3, 16]  # tokens on each request's last page
    assert pl.kv_len.tolist() == kv_lens
    assert pl.qo_indptr.tolist() == [0, 37, 38, 58, 59]
    for t in (pl.indptr, pl.last_page_len, pl.kv_len, pl.qo_indptr):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert pl.indices.dtype == meta.block_table.dtype
