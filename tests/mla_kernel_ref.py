"""Shared by the MLA kernel tests (CPU interpreter and GPU): random paged latent caches and the
float64 reference of weight-absorbed MLA attention over them."""

from __future__ import annotations

import torch

from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.quant import dequantize, quantize


def random_latent_batch(q_lens, kv_lens, heads, rank, rope, page, fmt_name, device,
                        q_dtype=torch.bfloat16, seed=0, scale=1.0):
    """(q [T, H, slab], cache [pages, P, slab] in the format, block_table [B, W] int32,
    cu_seqlens_q, kv_lens int32 tensors, the exact slabs [B][L, slab] float64 as stored
    (dequantized)). Pages of every request are scattered over the pool; unused pages hold NaN
    where the format has it (a read of an unwritten slot shows up)."""
    g = torch.Generator().manual_seed(seed)
    fmt = kv_format(fmt_name)
    slab = rank + rope
    need = [-(-k // page) for k in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    cache = torch.full((num_pages, page, slab), float("nan")).to(fmt.torch_dtype)
    width = max(need)
    table = torch.zeros((len(kv_lens), width), dtype=torch.int32)
    stored = []
    i = 0
    for b, k in enumerate(kv_lens):
        pages = perm[i:i + need[b]]
        i += need[b]
        table[b, :need[b]] = torch.tensor(pages, dtype=torch.int32)
        x = torch.randn(k, slab, generator=g) * 2.0
        xq = quantize(x.to(q_dtype), fmt, scale)  # [k, slab] in the pool dtype
        t = torch.arange(k)
        cache[torch.tensor(pages)[t // page], t % page] = xq
        stored.append(dequantize(xq, torch.float64, scale))
    q = (torch.randn(sum(q_lens), heads, slab, generator=g)).to(q_dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    dev = torch.device(device)
    return (q.to(dev), cache.to(dev), table.to(dev), cu.to(dev), kv.to(dev), stored)


def mla_reference(q, stored, q_lens, kv_lens, rank, sm_scale):
    """float64 [T, H, rank]: causal softmax(q . slab * sm_scale) @ latent per request."""
    out = []
    start = 0
    qd = q.double().cpu()
    for ql, kl, c in zip(q_lens, kv_lens, stored):
        qq = qd[start:start + ql]  # [ql, H, slab]
        s = torch.einsum("thd,nd->thn", qq, c) * sm_scale
        pos = torch.arange(kl - ql, kl)[:, None, None]
        s = s.masked_fill(torch.arange(kl)[None, None, :] > pos, float("-inf"))
        out.append(torch.einsum("thn,nr->thr", s.softmax(-1), c[:, :rank]))
        start += ql
    return torch.cat(out)
