"""The int4 decode-step store kernel (kernels/int4_store.py) against ``Int4KVCache.store_step``:
two pools fed the same prefill and decode steps (pages filling at different steps for each
request, residual slots not in request order); every page, scale, zero and residual byte must
be equal. Shared by the CPU test under the Triton interpreter and the GPU test."""

from __future__ import annotations

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.kernels.int4_store import int4_store_decode
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.int4_pool import Int4KVCache
from kvfit.kvcache.spec import KVLayerSpec

NAMES = ("k_caches", "v_caches", "k_scale_caches", "k_zero_caches", "v_scale_caches",
         "v_zero_caches", "k_residual", "v_residual")


def run_store_check(device, dtype, hkv=2, d=64, steps=40, seed=0, v_layout="HND") -> list[str]:
    """Names of the pool tensors that differ (empty: bit-exact)."""
    pools = [Int4KVCache([KVLayerSpec("full", hkv, d)], 16, 32, kv_format("int4"), device,
                         num_slots=4, residual_dtype=dtype, v_layout=v_layout) for _ in range(2)]
    for p in pools:
        for n in NAMES:
            getattr(p, n)[0].zero_()
    tables = [[3, 7, 1, 10], [0, 5, 9, 11], [2, 4, 6, 12]]
    slots, lens = [2, 0, 3], [30, 1, 63]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(sum(lens), hkv, d, generator=g) * 3 + 5
    v = torch.randn(sum(lens), hkv, d, generator=g)
    meta = build_metadata(lens, lens, tables, 32, device, residual_slots=slots)
    for p in pools:
        p.store_step(0, k.to(device, dtype), v.to(device, dtype), meta.residual)
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        # K with per-channel offsets up to 50 (real K has them), V plain
        k = (torch.randn(3, hkv, d, generator=g) * 3 + torch.linspace(-50, 50, d)).to(device,
                                                                                     dtype)
        v = torch.randn(3, hkv, d, generator=g).to(device, dtype)
        meta = build_metadata([1] * 3, lens, tables, 32, device, residual_slots=slots)
        pools[0].store_step(0, k, v, meta.residual)
        int4_store_decode(pools[1], 0, k, v, meta.block_table, meta.kv_lens, meta.residual.slots)
    return [n for n in NAMES if not torch.equal(getattr(pools[0], n)[0], getattr(pools[1], n)[0])]
