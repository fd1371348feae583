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


def decode_graph_replay_error(make_cfg, fmt_name, device="cuda", heads=16):
    """A decode captured in a CUDA graph, replayed after the cache, page table, lengths and query
    change (the second random batch at the captured batch size): asserts the replay equals an
    eager call bit for bit and returns its relative error against the float64 reference.
    ``make_cfg(batch, heads, max_len, cache, q)`` -> the ``MLAConfig`` under test."""
    from kvfit.kernels.mla import mla_decode

    page = 32 if fmt_name != "bfloat16" else 16
    kv_lens = [900, 40, 2100]
    q, cache, table, cu, kv, _ = random_latent_batch([1] * 3, kv_lens, heads, 512, 64, page,
                                                     fmt_name, device, seed=5)
    cfg = make_cfg(3, heads, 2304, cache, q)
    s = cfg.num_splits
    scratch = (torch.empty((3 * heads * s, 512), dtype=torch.float32, device=device),
               torch.empty((3 * heads * s,), dtype=torch.float32, device=device))
    out = torch.full((3, heads, 512), float("nan"), dtype=q.dtype, device=device)
    mla_decode(q, cache, table, cu, kv, out, 512, 0.07, cfg, scratch=scratch)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, table, cu, kv, out, 512, 0.07, cfg, scratch=scratch)
    q2, cache2, table2, _, _, stored2 = random_latent_batch([1] * 3, kv_lens, heads, 512, 64,
                                                            page, fmt_name, device, seed=6)
    new_lens = torch.tensor([899, 7, 2100], dtype=torch.int32, device=device)
    q.copy_(q2)
    cache.copy_(cache2)
    table.copy_(table2)
    kv.copy_(new_lens)
    out.fill_(float("nan"))
    graph.replay()
    eager = torch.empty_like(out)
    mla_decode(q, cache, table, cu, kv, eager, 512, 0.07, cfg)
    assert torch.equal(out, eager)
    ref = mla_reference(q, [st[:n] for st, n in zip(stored2, new_lens.tolist())], [1] * 3,
                        new_lens.tolist(), 512, 0.07)
    return ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
