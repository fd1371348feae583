"""The host side of a CUDA-graph decode replay (``engine/graph_staging.DecodeStaging``) against
the eager metadata builder: after each step the "device" buffers (CPU tensors here) hold the same
kv lens, block-table rows and slots for the real rows as ``build_metadata``, padding rows store
nothing, and the mirrors (used in turn) and the device's incremental row updates stay right as
requests' page lists change and rows shift between steps. Runs on CPU (no graph is captured)."""

from __future__ import annotations

import random

import pytest
import torch

from kvfit.attention.meta_builder import build_hybrid_metadata, build_metadata
from kvfit.engine.cuda_graph import capture_sizes, sliding_rows
from kvfit.engine.graph_staging import DecodeStaging
from kvfit.kvcache.sliding_pages import SlidingWindowPages

CPU = torch.device("cpu")


class _Stager:
    """The staging of graphs captured for ``capture_sizes(max_bs)`` (CPU "device"); with
    ``sliding`` (a ``SlidingWindowPages``) a second table for the sliding page space, its rows
    converted as ``DecodeGraphs.run`` does."""

    def __init__(self, max_bs: int, max_pages: int, page_size: int, sliding=None):
        self.sizes = capture_sizes(max_bs)
        self.sliding = sliding
        self.staging = DecodeStaging(max_bs, max_pages, page_size, "cpu",
                                     num_tables=1 if sliding is None else 2)

    def _stage(self, kv_lens, tables, swa_tables=None):
        gbs = min(s for s in self.sizes if s >= len(kv_lens))
        swa = None if swa_tables is None else sliding_rows(self.sliding, swa_tables)
        width, n_pages, kv_all = self.staging.stage(kv_lens, tables, gbs, swa)
        assert kv_all == list(kv_lens) + [1] * (gbs - len(kv_lens))
        st = self.staging
        out = (gbs, width, st.kv_lens[:gbs], st.block_table[:gbs], st.slot_mapping[:gbs],
               n_pages)
        if self.sliding is None:
            return out
        return out + (st.block_tables[1][:gbs], st.slot_mappings[1][:gbs])


def _stager(max_bs: int, max_pages: int, page_size: int, sliding=None) -> _Stager:
    return _Stager(max_bs, max_pages, page_size, sliding)


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
        gbs, width, dev_kv, table, slots, n_pages = g._stage(kv_lens, tables)
        assert gbs == min(s for s in g.sizes if s >= bs)
        assert width == max(-(-n // page_size) for n in kv_lens)
        ref = build_metadata([1] * bs, kv_lens, tables, page_size, torch.device("cpu"),
                             max_pages=width)
        assert dev_kv[:bs].tolist() == kv_lens and (dev_kv[bs:gbs] == 1).all()
        for i in range(bs):
            k = -(-kv_lens[i] // page_size)
            assert table[i, :k].tolist() == ref.block_table[i, :k].tolist()
        assert (table[bs:, :1] == 0).all()
        assert slots[:bs].tolist() == ref.slot_mapping.tolist()
        assert (slots[bs:] == -1).all()
        assert n_pages[:bs] == ref.num_pages_cpu and n_pages[bs:] == [1] * (gbs - bs)


def test_stage_rejects_a_short_page_list_and_a_too_wide_table():
    g = _stager(4, 8, 4)
    with pytest.raises(ValueError, match="pages for"):
        g._stage([9], [[1, 2]])
    with pytest.raises(ValueError, match="graphs were sized"):
        g._stage([40], [list(range(10))])


@pytest.mark.parametrize("page_size,window", [(4, 9), (16, 40)])
def test_stage_sliding_tables_match_build_hybrid_metadata(page_size, window):
    """A hybrid pool's graphs stage the sliding layers' table and slots too: the same rows
    (freed pages as the null page) and slots as the eager ``build_hybrid_metadata``, while the
    window slides and pages are released between steps."""
    rng = random.Random(window)
    sw = SlidingWindowPages(200, page_size, window)
    g = _stager(8, 64, page_size, sw)
    reqs = {}  # rid -> [kv_len, full pages]
    for step in range(80):
        if len(reqs) < 6 and rng.random() < 0.3:
            rid = f"r{step}"
            kv = rng.randint(1, 3 * window)
            sw.reserve(rid, 0, kv)
            reqs[rid] = [kv, rng.sample(range(5000), -(-kv // page_size))]
        if reqs and rng.random() < 0.1:
            rid = rng.choice(list(reqs))
            del reqs[rid]
            sw.free(rid)
        if not reqs:
            continue
        for rid, r in list(reqs.items()):
            if r[0] + 1 > 60 * page_size:
                del reqs[rid]
                sw.free(rid)
                continue
            sw.reserve(rid, r[0], r[0] + 1)  # the decode step computes position r[0]
            r[0] += 1
            while len(r[1]) < -(-r[0] // page_size):
                r[1].append(rng.randrange(5000))
        if not reqs:
            continue
        rids = list(reqs)
        rng.shuffle(rids)
        kv_lens = [reqs[r][0] for r in rids]
        tables = [reqs[r][1] for r in rids]
        swa = [sw.table(r) for r in rids]
        bs = len(rids)
        gbs, width, dev_kv, full, slots, _, sliding, swa_slots = g._stage(kv_lens, tables, swa)
        ref = build_hybrid_metadata([1] * bs, kv_lens, tables, swa, page_size, window,
                                    sw.null_page, CPU, max_pages=width)
        assert dev_kv[:bs].tolist() == kv_lens and (dev_kv[bs:gbs] == 1).all()
        for i in range(bs):
            k = -(-kv_lens[i] // page_size)
            assert full[i, :k].tolist() == ref.block_table[i, :k].tolist()
            assert sliding[i, :k].tolist() == ref.swa.block_table[i, :k].tolist()
        assert (sliding[bs:] == 0).all()
        assert slots[:bs].tolist() == ref.slot_mapping.tolist()
        assert swa_slots[:bs].tolist() == ref.swa.slot_mapping.tolist()
        assert (slots[bs:gbs] == -1).all() and (swa_slots[bs:gbs] == -1).all()
        for rid in rids:  # release after the step, as the scheduler may
            sw.release(rid, reqs[rid][0])
    with pytest.raises(ValueError, match="swa_tables"):
        g._stage([3], [[1]])
