"""Host-side prefill block order and store chunks (no GPU): every (request, row block) listed
once, heaviest first; every new position stored once, within its page."""

from __future__ import annotations

import random

import torch

from kvfit.kernels.prefill import PrefillConfig, order_prefill_blocks, prefill_config


def test_order_prefill_blocks_covers_every_row_block_once_heaviest_first():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 6)
        q_lens = [rng.randint(1, 300) for _ in range(n)]
        kv_lens = [q + rng.choice([0, rng.randint(1, 500)]) for q in q_lens]
        group, block_m = rng.choice([1, 2, 3, 4]), rng.choice([16, 64, 128])
        blocks = order_prefill_blocks(q_lens, group, block_m, "cpu", kv_lens).tolist()
        expect = {(i, r0) for i, ql in enumerate(q_lens) for r0 in range(0, ql * group, block_m)}
        assert len(blocks) == len(expect) and {tuple(b) for b in blocks} == expect
        # work of a block = KV tokens under its last row; non-increasing down the list
        work = [kv_lens[i] - q_lens[i] + min((r0 + block_m - 1) // group, q_lens[i] - 1)
                for i, r0 in blocks]
        assert work == sorted(work, reverse=True)


def test_order_prefill_blocks_without_kv_lens_means_no_prefix():
    a = order_prefill_blocks([5, 40], 2, 16, "cpu")
    b = order_prefill_blocks([5, 40], 2, 16, "cpu", [5, 40])
    assert torch.equal(a, b) and a[0].tolist() == [1, 64]


def test_prefill_config_choices():
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert prefill_config(128, bf16, bf16) == PrefillConfig(128, 64, 8, 5)
    assert prefill_config(128, bf16, fp8) == PrefillConfig(64, 64, 4, 5)
    assert prefill_config(64, bf16, fp8).num_stages == 2
    assert prefill_config(256, bf16, bf16).block_n == 32
    assert prefill_config(128, torch.float32, torch.float32).block_m == 16


def test_split_store_chunks_cover_new_positions_once_within_pages():
    from kvfit.kernels.store import chunk_tokens, split_store_chunks

    rng = random.Random(4)
    for page in (1, 8, 16, 32, 64):
        pp = chunk_tokens(page)
        assert pp <= 32 and page % pp == 0
        q_lens = [rng.randint(1, 200) for _ in range(5)]
        kv_lens = [q + rng.randint(0, 300) for q in q_lens]
        chunks = split_store_chunks(q_lens, kv_lens, page, "cpu").tolist()
        covered = []
        for i, a in chunks:
            assert a % pp == 0  # inside one page: [a, a + pp) never crosses a page edge
            covered += [(i, p) for p in range(a, a + pp)
                        if kv_lens[i] - q_lens[i] <= p < kv_lens[i]]
        expect = [(i, p) for i in range(5) for p in range(kv_lens[i] - q_lens[i], kv_lens[i])]
        assert sorted(covered) == expect
