"""Helpers of the int8 / K-centering GPU tests: the int8 format row, an int8 pool with scale
caches built directly (the kvcache pool of the int8 branch may add its own), a KV transform
that follows the format contract (k_mean per layer, Hadamard rotation, transform_qk)."""

from __future__ import annotations

import math

import torch

from kvfit.kvcache.pool import MHAKVCache
from kvfit.kvcache.spec import KVLayerSpec

from int8_reference import quantize_rows


def int8_format():
    """KV_FORMATS["int8"] where the table has it, else the row the contract describes."""
    from kvfit.kvcache.dtypes import KVFormat, kv_format

    try:
        return kv_format("int8")
    except ValueError:
        return KVFormat("int8", torch.int8, True, 127.0)


def hadamard(d: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [d, d] float32 (H @ H.T = I, symmetric)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


class ContractTransform:
    """``KVTransform`` as the format contract states it (torch): ``k' = (k - k_mean) @ H``,
    ``q' = q @ H``, identity parts skipped; returns float32 tensors."""

    def __init__(self, k_mean, rotate: bool, head_dim: int, device):
        self.k_mean = k_mean  # list per layer of [Hkv, D] float32, or None
        self.rotate = rotate
        self._h = hadamard(head_dim).to(device)

    def transform_qk(self, layer_id, q, k):
        q, k = q.float(), k.float()
        if self.k_mean is not None and self.k_mean[layer_id] is not None:
            k = k - self.k_mean[layer_id]
        if self.rotate:
            q, k = q @ self._h, k @ self._h
        return q, k


def make_int8_pool(page_size: int, hkv: int, d: int, num_pages: int, device,
                   v_layout: str = "HND", window=None, transform=None,
                   num_layers: int = 1) -> MHAKVCache:
    """An MHAKVCache of int8 pages plus float16 scale caches ``[pages, Hkv, P]`` per layer,
    every byte poisoned (random int8 bytes, NaN scales)."""
    spec = KVLayerSpec("sliding" if window else "full", hkv, d, window)
    pool = MHAKVCache([spec] * num_layers, num_pages, page_size, int8_format(), device,
                      v_layout=v_layout)
    for c in (*pool.k_caches, *pool.v_caches):
        c.copy_(torch.randint(-127, 128, c.shape, device=device, dtype=torch.int8))
    shape = (num_pages, hkv, page_size)
    pool.k_scale_caches = [torch.full(shape, float("nan"), dtype=torch.float16, device=device)
                           for _ in range(num_layers)]
    pool.v_scale_caches = [torch.full(shape, float("nan"), dtype=torch.float16, device=device)
                           for _ in range(num_layers)]
    pool.kv_transform = transform
    return pool


def store_pool_ref(pool, k, v, slots):
    """The reference store into an int8 test pool (k already transformed). Mutates the pool."""
    from int8_reference import store_ref

    store_ref(k, v, pool.k_caches[0], pool.v_caches[0], pool.k_scale_caches[0],
              pool.v_scale_caches[0], slots, pool.v_layout)


def gather_pool(pool, pages, length):
    from int8_reference import gather_ref

    return gather_ref(pool.k_caches[0], pool.v_caches[0], pool.k_scale_caches[0],
                      pool.v_scale_caches[0], pages, length, pool.v_layout)


def reference_attention(pool, q, meta, sm_scale, softcap=None):
    """float32 attention of q over the dequantized int8 pool."""
    from kvfit.attention.torch_attend import attend

    spec = pool.layers[0]
    window = spec.window if spec.kind == "sliding" else None
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (ql, kv) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
        pages = meta.block_table[i, : meta.num_pages_cpu[i]]
        kk, vv = gather_pool(pool, pages, kv)
        out[start:start + ql] = attend(q[start:start + ql].float(), kk, vv, sm_scale,
                                       window=window, softcap=softcap)
        start += ql
    return out


def fill_int8_prefix(pool, q_lens, kv_lens, tables, scale=1.0):
    """Random k/v stored (reference store) for each request's cached prefix."""
    from kvfit.attention.meta_builder import build_metadata

    pre = [kv - q for q, kv in zip(q_lens, kv_lens)]
    if sum(pre) == 0:
        return
    meta = build_metadata(pre, pre, tables, pool.page_size, pool.device)
    spec = pool.layers[0]
    n = sum(pre)
    k = torch.randn(n, spec.num_kv_heads, spec.head_dim, device=pool.device) * scale
    v = torch.randn(n, spec.num_kv_heads, spec.head_dim, device=pool.device) * scale
    store_pool_ref(pool, k, v, meta.slot_mapping)


__all__ = ["int8_format", "hadamard", "ContractTransform", "make_int8_pool", "store_pool_ref",
           "gather_pool", "reference_attention", "fill_int8_prefix", "quantize_rows"]
