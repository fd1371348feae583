"""Split-KV extend on the GPU (kernels/prefill_split.py): short extends over long cached
contexts in Qwen3-1.7B's head shape, every KV format the triton backend stores, against the
float32 reference over the dequantized pool and the plain (unsplit) kernel; a padded grid
(spare programs, extra rows) gives the same bits; poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata

from kvhelpers import DEV, fill_prefix, poison_, random_tables, reference, rel_err

pytestmark = pytest.mark.gpu


def _pool(kv_dtype, ps, hkv, d, num_pages, v_layout):
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    pool = MHAKVCache([KVLayerSpec("full", hkv, d)], num_pages, ps, kv_format(kv_dtype), DEV,
                      v_layout=v_layout)
    if pool.k_caches[0].dtype != torch.int8:
        poison_(pool.k_caches[0])
        poison_(pool.v_caches[0])
    return pool


@pytest.mark.parametrize("kv_dtype,ps,v_layout", [("bfloat16", 16, "HND"),
                                                  ("fp8_e4m3", 32, "HDN"),
                                                  ("fp8_e4m3", 16, "HND"),
                                                  ("int8", 32, "HDN")])
def test_split_extend_matches_reference(kv_dtype, ps, v_layout):
    from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
    from kvfit.kernels.prefill_split import ExtendSplit

    torch.manual_seed(11)
    hq, hkv, d = 16, 8, 128
    q_lens, kv_lens = [128, 7, 1, 40], [4224, 2000, 3001, 40]
    num_pages = sum(-(-n // ps) for n in kv_lens) + 1
    pool = _pool(kv_dtype, ps, hkv, d, num_pages, v_layout)
    tables = random_tables(kv_lens, ps, num_pages)
    fill_prefix(pool, [0] * 4, kv_lens, tables, torch.bfloat16, scale=2.0)
    meta = build_metadata(q_lens, kv_lens, tables, ps, DEV)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=torch.bfloat16) * 2
    cfg = prefill_config(d, q.dtype, pool.dtype)
    blocks = order_prefill_blocks(q_lens, hq // hkv, cfg.block_m, DEV, kv_lens)
    kw = dict(v_t=v_layout == "HDN")
    if pool.k_caches[0].dtype == torch.int8:
        kw.update(k_scale_cache=pool.k_scale_caches[0], v_scale_cache=pool.v_scale_caches[0])
    args = (pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.cu_seqlens_q, meta.kv_lens)
    ref = reference(pool, q, meta, d ** -0.5)
    outs = []
    for split in (None, ExtendSplit()):
        out = poison_(torch.empty_like(q))
        paged_prefill(q, *args, blocks, cfg, out, d ** -0.5, split=split, **kw)
        assert rel_err(out, ref) < 6e-3, split
        outs.append(out)
    assert rel_err(outs[1], outs[0].float()) < 6e-3
    # a padded grid: spare blocks and rows of a CUDA-graph bucket, the same bits
    pad_blocks = torch.cat([blocks, torch.full((5, 2), -1, dtype=torch.int32, device=DEV)])
    pad_q = torch.cat([q, torch.randn(20, hq, d, device=DEV, dtype=q.dtype)])
    out = poison_(torch.empty_like(pad_q))
    paged_prefill(pad_q, *args, pad_blocks, cfg, out, d ** -0.5, split=ExtendSplit(), **kw)
    assert torch.equal(out[:q.shape[0]], outs[1])
