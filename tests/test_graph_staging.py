"""The host side of a CUDA-graph decode replay (``DecodeGraphs._stage``) against the eager
metadata builder: same kv lens, block-table rows and slots for the real rows, padding rows that
store nothing, and a host mirror that stays right as requests' page lists change and rows
shift between steps. Runs on CPU (no graph is captured)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.engine.cuda_graph import DecodeGraphs, capture_sizes


def _stager(max_bs: int, max_pages: int, page_size: int) -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)  # host state only: no model, no capture
    g.page_size, g.max_bs, g.max_pages = page_size, max_bs, max_pages
    g.sizes = capture_sizes(max_bs)
    g._host_table = np.zeros((max_bs, max_pages), dtype=np.int32)
    g._host_rows = [None] * max_bs
    return g


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_stage_matches_build_metadata(page_size):
    rng = random.Random(page_size)
    g = _stager(40, 64, page_size)
    reqs = {}  # request id -> (kv_len, pages)
    for step in range(60):
        # admit, finish and grow requests so rows shift and page lists change between steps
        if len(reqs) < 37 and rng.random() < 0.5:
            rid = step
            kv = rng.randint(1, 40 * page_size)
            reqs[rid] = [kv, rng.sample(range(5000), -(-kv // page_size))]
        if reqs and rng.random() < 0.3:
            del reqs[rng.choice(list(reqs))]
        if not reqs:
            continue
        for r in reqs.values():
            r[0] += 1
            while len(r[1]) < -(-r[0] // page_size):
                r[1].append(rng.randrange(5000))
            if r[0] >= 60 * page_size:  # would outgrow the graph's table: restart the row
                r[0], r[1] = 1, [rng.randrange(5000)]
        order = list(reqs.values())
        rng.shuffle(order)
        kv_lens = [r[0] for r in order]
        tables = [r[1] for r in order]
        bs = len(order)
        gbs, width, ints, slots, n_pages = g._stage(kv_lens, tables)
        assert gbs == min(s for s in g.sizes if s >= bs)
        ref = build_metadata([1] * bs, kv_lens, tables, page_size, torch.device("cpu"),
                             max_pages=width)
        assert ints[:bs].tolist() == kv_lens and (ints[bs:gbs] == 1).all()
        table = ints[gbs:].reshape(gbs, width)
        for i in range(bs):
            k = -(-kv_lens[i] // page_size)
            assert table[i, :k].tolist() == ref.block_table[i, :k].tolist()
        assert (table[bs:] == 0).all()
        assert slots[:bs].tolist() == ref.slot_mapping.tolist()
        assert (slots[bs:] == -1).all()
        assert n_pages[:bs].tolist() == ref.num_pages_cpu


def test_stage_rejects_a_short_page_list_and_a_too_wide_table():
    g = _stager(4, 8, 4)
    with pytest.raises(ValueError, match="pages for"):
        g._stage([9], [[1, 2]])
    with pytest.raises(ValueError, match="graphs were sized"):
        g._stage([40], [list(range(10))])
