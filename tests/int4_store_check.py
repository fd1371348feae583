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


def run_pages_check(device, dtype, v_layout="HND", hkv=2, d=64, seed=1) -> list[str]:
    """The prefill kernels against the torch pool: staged pages quantized by ``int4_store_pages``
    and by ``Int4KVCache.quantize_pages`` (every byte equal), then pages dequantized by
    ``int4_dequant_pages`` and by the pool's reference reader (every value equal). Names of
    what differs (empty: bit-exact)."""
    from kvfit.kernels.int4_dequant import int4_dequant_pages
    from kvfit.kernels.int4_store import int4_store_pages

    pools = [Int4KVCache([KVLayerSpec("full", hkv, d)], 12, 32, kv_format("int4"), device,
                         num_slots=1, residual_dtype=dtype, v_layout=v_layout) for _ in range(2)]
    for p in pools:
        for n in NAMES:
            getattr(p, n)[0].zero_()
    g = torch.Generator().manual_seed(seed)
    # [F, P, H, D]: K with per-channel offsets, V plain, one page of a constant (zero range)
    k = torch.randn(5, 32, hkv, d, generator=g) * 3 + torch.linspace(-40, 40, d)
    v = torch.randn(5, 32, hkv, d, generator=g)
    k[2] = 7.0
    k, v = k.to(device, dtype), v.to(device, dtype)
    pages = torch.tensor([9, 0, 4, 11, 6], device=device)
    pools[0].quantize_pages(0, k, v, pages)
    int4_store_pages(pools[1], 0, k, v, pages)
    bad = [n for n in NAMES if not torch.equal(getattr(pools[0], n)[0], getattr(pools[1], n)[0])]
    out_k = torch.full((6, hkv, 32, d), float("nan"), dtype=dtype, device=device)
    out_v = out_k.clone()
    dst = torch.tensor([3, 0, 5, 1, 2], device=device)
    int4_dequant_pages(pools[1], 0, pages, dst, out_k, out_v)
    want_v = pools[1].dequantize_v(0, pages, dtype)  # [n, H, P, D]
    for i, pg in enumerate(pages.tolist()):
        kk, _ = pools[1].gather_kv(0, torch.tensor([pg], device=device), 32, dtype)
        if not torch.equal(out_k[dst[i]], kk.transpose(0, 1)):  # [P, H, D] -> [H, P, D]
            bad.append(f"dequantized K of page {pg}")
        if not torch.equal(out_v[dst[i]], want_v[i]):
            bad.append(f"dequantized V of page {pg}")
    if not torch.isnan(out_k[4]).all():
        bad.append("a row not listed was written")
    return bad
