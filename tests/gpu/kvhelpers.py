"""Shared helpers of the GPU kernel tests: random paged pools and a float32 reference."""

from __future__ import annotations

import random

import torch

from kvfit.attention.torch_attend import attend
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.pool import MHAKVCache
from kvfit.kvcache.spec import KVLayerSpec

DEV = torch.device("cuda")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (0x7F bytes are NaN in e4m3fn and e5m2 too)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def make_pool(kv_dtype: str, page_size: int, hkv: int, d: int, num_pages: int,
              k_scale: float = 1.0, v_scale: float = 1.0, window=None,
              v_layout: str = "HND") -> MHAKVCache:
    spec = KVLayerSpec("sliding" if window else "full", hkv, d, window)
    pool = MHAKVCache([spec], num_pages, page_size, kv_format(kv_dtype), DEV, [k_scale], [v_scale],
                      v_layout=v_layout)
    poison_(pool.k_caches[0])
    poison_(pool.v_caches[0])
    return pool


def clone_pool(pool: MHAKVCache) -> MHAKVCache:
    other = MHAKVCache(pool.layers, pool.num_pages, pool.page_size, pool.fmt, pool.device,
                       pool.k_scales, pool.v_scales, v_layout=pool.v_layout)
    other.k_caches[0].copy_(pool.k_caches[0])
    other.v_caches[0].copy_(pool.v_caches[0])
    return other


def random_tables(kv_lens, page_size, num_pages, seed=0):
    """Disjoint random page lists, one per request."""
    rng = random.Random(seed)
    need = [-(-kv // page_size) for kv in kv_lens]
    pages = list(range(num_pages))
    rng.shuffle(pages)
    out, i = [], 0
    for n in need:
        out.append(pages[i:i + n])
        i += n
    assert i <= num_pages
    return out


def fill_prefix(pool, q_lens, kv_lens, tables, dtype, scale=1.0):
    """Store random k/v for each request's cached prefix (positions before this step)."""
    from kvfit.attention.meta_builder import build_metadata

    pre = [kv - q for q, kv in zip(q_lens, kv_lens)]
    if sum(pre) == 0:
        return
    meta = build_metadata(pre, pre, tables, pool.page_size, DEV)
    spec = pool.layers[0]
    n = sum(pre)
    k = torch.randn(n, spec.num_kv_heads, spec.head_dim, device=DEV, dtype=dtype) * scale
    v = torch.randn(n, spec.num_kv_heads, spec.head_dim, device=DEV, dtype=dtype) * scale
    pool.store_kv(0, k, v, meta.slot_mapping)


def reference(pool, q, meta, sm_scale, softcap=None):
    """float32 attention over the dequantized pool (the exact function the kernels compute)."""
    spec = pool.layers[0]
    window = spec.window if spec.kind == "sliding" else None
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (ql, kv) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
        if ql == 0:
            continue
        pages = meta.block_table[i, : meta.num_pages_cpu[i]]
        kk, vv = pool.gather_kv(0, pages, kv, torch.float32)
        out[start:start + ql] = attend(q[start:start + ql].float(), kk, vv, sm_scale,
                                       window=window, softcap=softcap)
        start += ql
    return out


def backend_step(backend_cls, pool, q_lens, kv_lens, tables, hq: int, cdt: torch.dtype,
                 sm_scale: float):
    """One store + attention step through ``backend_cls`` and through TorchRefBackend on a copy
    of the pool (random cached prefix, random q/k/v). Asserts both stored the same bytes;
    returns (backend output, float32 reference over the dequantized pool)."""
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.torch_ref import TorchRefBackend

    fill_prefix(pool, q_lens, kv_lens, tables, cdt)
    ref_pool = clone_pool(pool)
    meta = build_metadata(q_lens, kv_lens, tables, pool.page_size, DEV)
    spec = pool.layers[0]
    t = sum(q_lens)
    q = torch.randn(t, hq, spec.head_dim, device=DEV, dtype=cdt)
    k = torch.randn(t, spec.num_kv_heads, spec.head_dim, device=DEV, dtype=cdt)
    v = torch.randn(t, spec.num_kv_heads, spec.head_dim, device=DEV, dtype=cdt)
    outs = []
    for cls, p in ((backend_cls, pool), (TorchRefBackend, ref_pool)):
        be = cls(p, cdt, sm_scale)
        be.prepare(meta)
        outs.append(be.forward(q, k, v, 0))
    assert torch.equal(pool.k_caches[0].view(torch.uint8), ref_pool.k_caches[0].view(torch.uint8))
    assert torch.equal(pool.v_caches[0].view(torch.uint8), ref_pool.v_caches[0].view(torch.uint8))
    return outs[0], reference(pool, q, meta, sm_scale)


def rel_err(out, ref) -> float:
    out = out.float()
    assert not torch.isnan(out).any(), "NaN in output (unwritten or poisoned read)"
    return ((out - ref).norm() / ref.norm()).item()


# error bound per compute dtype (the kernels' output rounding dominates)
BOUND = {torch.float32: 1e-5, torch.bfloat16: 6e-3, torch.float16: 2e-3}
