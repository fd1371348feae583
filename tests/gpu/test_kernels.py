"""Triton kernels (store, paged decode, paged prefill) and the triton backend vs the torch
reference, on fresh random inputs, with poisoned pages and outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.kvcache.quant import quantize

from kvhelpers import (BOUND, DEV, backend_step, clone_pool, fill_prefix, make_pool, poison_,
                       random_tables, reference, rel_err)

pytestmark = pytest.mark.gpu

KV_DTYPES = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "float32"]
V_LAYOUTS = ["HND", "HDN"]  # V pages [H, P, D] or token-minor [H, D, P]
# head layouts per head_dim: (q heads, kv heads) -> groups 3, 4 and 2 (and MHA below)
HEADS = {64: (9, 3), 128: (32, 8), 256: (8, 4)}


def compute_dtype(kv_dtype: str) -> torch.dtype:
    return {"float16": torch.float16, "float32": torch.float32}.get(kv_dtype, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 32])  # 32: the fastest fp8 token-minor page
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("v_layout", V_LAYOUTS)
def test_store_bit_exact(kv_dtype, page_size, scales, v_layout):
    from kvfit.kernels.store import store_kv

    torch.manual_seed(1)
    num_pages = 128 if page_size == 1 else 40
    pool = make_pool(kv_dtype, page_size, 4, 128, num_pages, *scales, v_layout=v_layout)
    t = 100
    k = torch.randn(t, 4, 128, device=DEV, dtype=compute_dtype(kv_dtype)) * 3
    v = torch.randn(t, 4, 128, device=DEV, dtype=compute_dtype(kv_dtype)) * 3
    k[::7] *= 1000  # saturates the fp8 formats
    slots = torch.randperm(num_pages * page_size, device=DEV)[:t]
    slots[::5] = -1  # padding: skipped
    kc, vc = pool.k_caches[0].clone(), pool.v_caches[0].clone()
    store_kv(k, v, kc, vc, slots, pool.fmt, *scales, v_layout)
    pool.store_kv(0, k, v, slots)  # torch reference
    assert torch.equal(kc.view(torch.uint8), pool.k_caches[0].view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), pool.v_caches[0].view(torch.uint8))
    q = quantize(k[1], pool.fmt, scales[0])
    assert not q.float().isnan().any()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_store_chunks_matches_slot_store(kv_dtype, page_size, scales):
    """Prefill-step store into token-minor V pages by page-row chunks writes exactly the bytes
    of the slot-mapped store (mixed batch: prefix + chunk, decode rows, chunks off page edges),
    and nothing else (random pages elsewhere stay as they were)."""
    from kvfit.kernels.store import split_store_chunks, store_kv, store_kv_chunks

    torch.manual_seed(2)
    q_lens, kv_lens = [37, 1, 70, 5, 64], [37, 50, 153, 1029, 64]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    pool = make_pool(kv_dtype, page_size, 4, 128, num_pages, *scales, v_layout="HDN")
    tables = random_tables(kv_lens, page_size, num_pages, seed=3)
    meta = build_metadata(q_lens, kv_lens, tables, page_size, DEV)
    t = sum(q_lens)
    k = torch.randn(t, 4, 128, device=DEV, dtype=torch.bfloat16) * 3
    v = torch.randn(t, 4, 128, device=DEV, dtype=torch.bfloat16) * 3
    v[::9] *= 1000  # saturates the fp8 formats
    for c in (pool.k_caches[0], pool.v_caches[0]):  # random finite bytes everywhere before
        u = c.view(torch.uint8)
        u.copy_(torch.randint(0, 120, u.shape, device=DEV, dtype=torch.uint8))
    kc, vc = pool.k_caches[0].clone(), pool.v_caches[0].clone()
    store_kv(k, v, kc, vc, meta.slot_mapping, pool.fmt, *scales, "HDN")
    chunks = split_store_chunks(q_lens, kv_lens, page_size, DEV)
    kc2, vc2 = pool.k_caches[0].clone(), pool.v_caches[0].clone()
    store_kv_chunks(k, v, kc2, vc2, chunks, meta.cu_seqlens_q, meta.kv_lens, meta.block_table,
                    pool.fmt, *scales)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    assert not torch.equal(vc.view(torch.uint8), pool.v_caches[0].view(torch.uint8))


DECODE_LENS = [[1, 17, 300, 1000, 5], [4097], [33] * 40]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 32])  # 32: the fastest fp8 token-minor page
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lens_idx", [0, 1, 2])
@pytest.mark.parametrize("v_layout", V_LAYOUTS)
def test_decode(kv_dtype, page_size, d, lens_idx, v_layout):
    from kvfit.kernels.decode import choose_config, paged_decode

    torch.manual_seed(2 + lens_idx)
    hq, hkv = HEADS[d]
    kv_lens = DECODE_LENS[lens_idx]
    b = len(kv_lens)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    scales = (0.5, 1.7) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, page_size, hkv, d, num_pages, *scales, v_layout=v_layout)
    tables = random_tables(kv_lens, page_size, num_pages, seed=lens_idx)
    cdt = compute_dtype(kv_dtype)
    fill_prefix(pool, [0] * b, kv_lens, tables, cdt)
    meta = build_metadata([1] * b, kv_lens, tables, page_size, DEV)
    q = torch.randn(b, hq, d, device=DEV, dtype=cdt)
    ref = reference(pool, q, meta, d ** -0.5)
    v_t = v_layout == "HDN"
    configs = [choose_config(b, hkv, hq // hkv, d, max(kv_lens), pool.dtype, cdt, v_t=v_t)]
    if cdt != torch.float32:  # the other inner product, single and split
        configs.append(choose_config(b, hkv, hq // hkv, d, max(kv_lens), pool.dtype, cdt,
                                     use_dot=not configs[0].use_dot, v_t=v_t))
    for cfg in configs:
        for splits in sorted({cfg.num_splits, 1, 3}):
            c = dataclasses.replace(cfg, num_splits=splits)
            out = poison_(torch.empty_like(q))
            paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens,
                         out, d ** -0.5, c, *scales)
            err = rel_err(out, ref)
            assert err < BOUND[cdt], (c, err)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("d,v_layout,page_size", [(64, "HND", 16), (64, "HDN", 32),
                                                  (64, "HDN", 16), (128, "HDN", 32)])
@pytest.mark.parametrize("heads,block_n", [("all", 32), ("all", 64), (2, 64)])
def test_decode_heads(kv_dtype, d, v_layout, page_size, heads, block_n):
    """Several KV heads per program (kernels/decode_heads.py): all that fit the 16 MMA rows in
    a 256-column tile (3 of 4 live for the 64-d layout's 3 KV heads) or 2, against the float64
    reference, mixed lengths, one and three splits."""
    from kvfit.kernels.decode import choose_config, paged_decode

    torch.manual_seed(7)
    hq, hkv = HEADS[d]
    kv_lens = DECODE_LENS[0]
    b = len(kv_lens)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    scales = (0.5, 1.7) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, page_size, hkv, d, num_pages, *scales, v_layout=v_layout)
    tables = random_tables(kv_lens, page_size, num_pages, seed=1)
    cdt = compute_dtype(kv_dtype)
    fill_prefix(pool, [0] * b, kv_lens, tables, cdt)
    meta = build_metadata([1] * b, kv_lens, tables, page_size, DEV)
    q = torch.randn(b, hq, d, device=DEV, dtype=cdt)
    ref = reference(pool, q, meta, d ** -0.5)
    if heads == "all":
        heads = max(h for h in (2, 4, 8) if h * (hq // hkv) <= 16 and h * d <= 256)
    cfg = choose_config(b, hkv, hq // hkv, d, max(kv_lens), pool.dtype, cdt,
                        v_t=v_layout == "HDN")
    cfg = dataclasses.replace(cfg, heads=heads, block_n=block_n, num_stages=3)
    for splits in (1, 3):
        c = dataclasses.replace(cfg, num_splits=splits)
        out = poison_(torch.empty_like(q))
        paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens,
                     out, d ** -0.5, c, *scales)
        err = rel_err(out, ref)
        assert err < BOUND[cdt], (c, err)


PREFILL_CASES = [
    # (q_lens, kv_lens): empty prefix, decode rows in a mixed batch, prefix + chunk, long chunk
    ([37, 1, 20, 130], [37, 50, 83, 300]),
    ([1], [1]),
    ([200], [200]),
    ([5, 1, 1, 64], [1029, 16, 17, 64]),
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 32])  # 32: the fastest fp8 token-minor page
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("v_layout", V_LAYOUTS)
def test_prefill_backend(kv_dtype, page_size, d, case, v_layout):
    """Whole backend step (store + prefill) vs TorchRefBackend, caches compared bit for bit."""
    from kvfit.attention.triton_backend import TritonBackend

    torch.manual_seed(10 + case)
    hq, hkv = HEADS[d]
    q_lens, kv_lens = PREFILL_CASES[case]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 2
    scales = (0.8, 1.3) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, page_size, hkv, d, num_pages, *scales, v_layout=v_layout)
    tables = random_tables(kv_lens, page_size, num_pages, seed=case)
    cdt = compute_dtype(kv_dtype)
    out, ref = backend_step(TritonBackend, pool, q_lens, kv_lens, tables, hq, cdt, d ** -0.5)
    err = rel_err(out, ref)
    assert err < BOUND[cdt], err


@pytest.mark.parametrize("launch", [None, (128, 64, 8, 5), (64, 32, 4, 5), (64, 64, 4, 2)])
def test_prefill_poisoned_output_and_window_softcap(launch):
    """Kernel-level: every output row written (poisoned out), sliding window + softcap honoured,
    under the default launch and others (row blocks and tiles that cut the causal diagonal and
    the window edge at different places)."""
    from kvfit.kernels.decode import choose_config, paged_decode
    from kvfit.kernels.prefill import (PrefillConfig, order_prefill_blocks, paged_prefill,
                                       prefill_config)

    torch.manual_seed(5)
    hq, hkv, d, ps = 16, 8, 128, 16
    q_lens, kv_lens = [40, 1, 77], [100, 300, 77]
    num_pages = sum(-(-n // ps) for n in kv_lens) + 1
    for (window, softcap), v_layout in [(c, lay) for c in [(None, None), (50, None), (None, 30.0),
                                                          (64, 20.0), (13, None)]
                                        for lay in V_LAYOUTS]:
        v_t = v_layout == "HDN"
        pool = make_pool("fp8_e4m3", ps, hkv, d, num_pages, 0.9, 1.1, window=window,
                         v_layout=v_layout)
        tables = random_tables(kv_lens, ps, num_pages)
        fill_prefix(pool, [0] * 3, kv_lens, tables, torch.bfloat16, scale=3.0)
        meta = build_metadata(q_lens, kv_lens, tables, ps, DEV)
        q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=torch.bfloat16) * 3
        cfg = PrefillConfig(*launch) if launch else prefill_config(d, q.dtype, pool.dtype)
        out = poison_(torch.empty_like(q))
        blocks = order_prefill_blocks(q_lens, hq // hkv, cfg.block_m, DEV, kv_lens)
        paged_prefill(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.cu_seqlens_q,
                      meta.kv_lens, blocks, cfg, out, d ** -0.5, 0.9, 1.1, softcap, window,
                      v_t=v_t)
        ref = reference(pool, q, meta, d ** -0.5, softcap)
        assert rel_err(out, ref) < 6e-3, (window, softcap, v_layout)
        # decode over the same pool (one token per request)
        dmeta = build_metadata([1] * 3, kv_lens, tables, ps, DEV)
        qd = q[:3].contiguous()
        ref_d = reference(pool, qd, dmeta, d ** -0.5, softcap)
        for use_dot in (True, False):
            cfg = choose_config(3, hkv, 2, d, 300, pool.dtype, q.dtype, use_dot=use_dot,
                                v_t=v_t)
            outd = poison_(torch.empty_like(qd))
            paged_decode(qd, pool.k_caches[0], pool.v_caches[0], dmeta.block_table,
                         dmeta.kv_lens, outd, d ** -0.5, cfg, 0.9, 1.1, softcap, window)
            assert rel_err(outd, ref_d) < 6e-3, (window, softcap, v_layout, use_dot)


def test_backend_decode_steps_match_reference():
    """A prefill then several decode steps through TritonBackend vs TorchRefBackend."""
    from kvfit.attention.torch_ref import TorchRefBackend
    from kvfit.attention.triton_backend import TritonBackend

    torch.manual_seed(7)
    hq, hkv, d, ps = 16, 8, 128, 16
    for kv_dtype in ["bfloat16", "fp8_e4m3"]:
        pool = make_pool(kv_dtype, ps, hkv, d, 64, v_layout=TritonBackend.v_layout(kv_dtype, ps, d))
        ref_pool = clone_pool(pool)
        tables = random_tables([200, 150, 90], ps, 64)
        be, rb = TritonBackend(pool, torch.bfloat16, d ** -0.5), TorchRefBackend(
            ref_pool, torch.bfloat16, d ** -0.5)
        lens = [180, 3, 90]
        for step in range(4):
            q_lens = lens if step == 0 else [1, 1, 1]
            kv_lens = lens if step == 0 else [l + step for l in lens]
            meta = build_metadata(q_lens, kv_lens, tables, ps, DEV)
            t = sum(q_lens)
            q, k, v = (torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
            be.prepare(meta)
            rb.prepare(meta)
            out = be.forward(q, k, v, 0)
            ro = rb.forward(q, k, v, 0)
            assert rel_err(out, ro.float()) < 1e-2
