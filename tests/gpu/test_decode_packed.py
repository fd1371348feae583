"""Packed decode (R sub-splits in the 16 MMA rows, kernels/decode_packed.py) against a float32
reference over the dequantized pages, for every KV format, query groups of 1-4, NaN-poisoned
outputs, one and several splits, sliding window and soft-capping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata

from int8helpers import fill_int8_prefix, make_int8_pool, reference_attention
from kvhelpers import BOUND, DEV, fill_prefix, make_pool, poison_, random_tables, reference, rel_err

pytestmark = pytest.mark.gpu

# (q heads, kv heads, pack): groups 3 and 4 in 4 sub-splits, 2 in 8, 1 in 16
LAYOUTS = [(9, 3, 4), (8, 2, 4), (4, 2, 8), (3, 3, 16)]
LENS = [[1, 17, 300, 1000, 5], [4097]]


def _pool(kv_dtype, ps, hkv, d, num_pages, tables, kv_lens, window=None):
    if kv_dtype == "int8":
        pool = make_int8_pool(ps, hkv, d, num_pages, DEV, window=window)
        fill_int8_prefix(pool, [0] * len(kv_lens), kv_lens, tables, scale=2.0)
        return pool, dict(k_scale_cache=pool.k_scale_caches[0],
                          v_scale_cache=pool.v_scale_caches[0]), (1.0, 1.0)
    scales = (0.5, 1.7) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, ps, hkv, d, num_pages, *scales, window=window)
    cdt = torch.float16 if kv_dtype == "float16" else torch.bfloat16
    fill_prefix(pool, [0] * len(kv_lens), kv_lens, tables, cdt, scale=2.0)
    return pool, {}, scales


def _ref(pool, q, meta, sm_scale, softcap=None):
    if pool.dtype == torch.int8:
        return reference_attention(pool, q, meta, sm_scale, softcap)
    return reference(pool, q, meta, sm_scale, softcap)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lens_idx", [0, 1])
def test_packed_decode(kv_dtype, layout, d, lens_idx):
    from kvfit.kernels.decode import choose_config, paged_decode

    hq, hkv, pack = layout
    if pack * d > 512:
        pytest.skip("tile rows wider than 512 elements")
    torch.manual_seed(lens_idx + d + pack)
    kv_lens, ps = LENS[lens_idx], 16
    b = len(kv_lens)
    num_pages = sum(-(-n // ps) for n in kv_lens) + 3
    tables = random_tables(kv_lens, ps, num_pages, seed=lens_idx)
    pool, kw, scales = _pool(kv_dtype, ps, hkv, d, num_pages, tables, kv_lens)
    meta = build_metadata([1] * b, kv_lens, tables, ps, DEV)
    cdt = torch.float16 if kv_dtype == "float16" else torch.bfloat16
    q = torch.randn(b, hq, d, device=DEV, dtype=cdt)
    ref = _ref(pool, q, meta, d ** -0.5)
    base = choose_config(b, hkv, hq // hkv, d, max(kv_lens), pool.dtype, cdt)
    cvts = ["asm", "bias", "cast"] if kv_dtype == "int8" else ["asm"]
    for block_n, i8_cvt in [(n, c) for n in (64, 128, 256) if n >= 16 * pack for c in cvts]:
        for splits in (1, 3):
            cfg = dataclasses.replace(base, pack=pack, block_n=block_n, num_splits=splits,
                                      i8_cvt=i8_cvt)
            out = poison_(torch.empty_like(q))
            paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens,
                         out, d ** -0.5, cfg, *scales, **kw)
            assert rel_err(out, ref) < BOUND[cdt], (cfg, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("window,softcap", [(50, None), (None, 30.0), (13, 20.0)])
def test_packed_decode_window_softcap(kv_dtype, window, softcap):
    from kvfit.kernels.decode import choose_config, paged_decode

    torch.manual_seed(4)
    hq, hkv, d, ps = 9, 3, 64, 16
    kv_lens = [100, 300, 77, 1]
    num_pages = sum(-(-n // ps) for n in kv_lens) + 1
    tables = random_tables(kv_lens, ps, num_pages)
    pool, kw, scales = _pool(kv_dtype, ps, hkv, d, num_pages, tables, kv_lens, window)
    meta = build_metadata([1] * 4, kv_lens, tables, ps, DEV)
    q = torch.randn(4, hq, d, device=DEV, dtype=torch.bfloat16) * 3
    ref = _ref(pool, q, meta, d ** -0.5, softcap)
    for splits in (1, 2):
        cfg = dataclasses.replace(choose_config(4, hkv, 3, d, 300, pool.dtype, q.dtype),
                                  pack=4, block_n=128, num_splits=splits)
        out = poison_(torch.empty_like(q))
        paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens,
                     out, d ** -0.5, cfg, *scales, softcap=softcap, window=window, **kw)
        assert rel_err(out, ref) < 6e-3


def test_pack_refuses_what_it_cannot_hold():
    from kvfit.kernels.decode import choose_config, paged_decode

    pool = make_pool("bfloat16", 16, 2, 64, 4)
    q = torch.randn(1, 16, 64, device=DEV, dtype=torch.bfloat16)  # group 8 > 16 / 4
    meta = build_metadata([1], [20], [[0, 1]], 16, DEV)
    cfg = dataclasses.replace(choose_config(1, 2, 8, 64, 20, pool.dtype, q.dtype), pack=4)
    with pytest.raises(ValueError, match="pack=4"):
        paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens,
                     torch.empty_like(q), 0.125, cfg)
