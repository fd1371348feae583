"""The int4 Triton decode kernel against the torch reference (the pool's own dequantized pages and
residual, attention in float64). Shared by the CPU interpreter test (tests/test_int4_kernel.py)
and the GPU test (tests/gpu/test_int4_decode.py)."""

from __future__ import annotations

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.torch_attend import attend
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.int4_pool import Int4KVCache
from kvfit.kvcache.spec import KVLayerSpec


def filled_pool(kv_lens, hkv, d, device, dtype, seed=0, chunk=45, v_layout="HND"):
    """An int4 pool holding ``len(kv_lens)`` requests of random K/V (prefilled in chunks that
    cross pages, so pages are completed from the residual), one residual slot each."""
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    pages_each = [-(-n // 32) for n in kv_lens]
    pool = Int4KVCache([KVLayerSpec("full", hkv, d)], sum(pages_each) + 1, 32, kv_format("int4"),
                       device, num_slots=b, residual_dtype=dtype, v_layout=v_layout)
    perm = torch.randperm(sum(pages_each), generator=g).tolist()  # scattered pages
    tables, at = [], 0
    for n in pages_each:
        tables.append(perm[at:at + n])
        at += n
    done = [0] * b
    while any(x < n for x, n in zip(done, kv_lens)):
        q_lens = [min(chunk, n - x) for x, n in zip(done, kv_lens)]
        done = [x + q for x, q in zip(done, q_lens)]
        t = sum(q_lens)
        # K with a per-channel offset (as real K has), V plain
        k = (torch.randn(t, hkv, d, generator=g) * 2 + torch.randn(1, hkv, d, generator=g) * 8)
        v = torch.randn(t, hkv, d, generator=g)
        meta = build_metadata(q_lens, done, tables, 32, device, residual_slots=list(range(b)))
        pool.store_step(0, k.to(device, dtype), v.to(device, dtype), meta.residual)
    return pool, tables


def decode_problem(dtype=torch.bfloat16, residual=None, lens=(70, 33, 100), v_layout="HND"):
    """A small CPU decode call: (q [3, 6, 64], a filled pool of 2 KV heads, block table,
    kv lens, residual slots)."""
    pool, tables = filled_pool(list(lens), 2, 64, torch.device("cpu"), residual or dtype,
                               v_layout=v_layout)
    b = len(lens)
    q = torch.randn(b, 6, 64, dtype=dtype)
    bt = torch.zeros(b, max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return q, pool, bt, torch.tensor(lens, dtype=torch.int32), torch.arange(b, dtype=torch.int32)


def reference(q, pool, tables, kv_lens, sm_scale):
    """float64 attention over the pool's dequantized pages + residual (what the kernel reads)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(kv_lens):
        pages = torch.tensor(tables[i], device=q.device)
        k, v = pool.gather_kv(0, pages, n, torch.float64, residual_slot=i)
        out[i:i + 1] = attend(q[i:i + 1].double(), k, v, sm_scale).cpu()
    return out


def run_check(device, dtype, kv_lens, hq, hkv, d, rtol, num_splits=1, pages_per_tile=2,
              asm=True, num_warps=4, num_stages=2, fold_k=False, ks_tokens=False, gluon=False,
              v_layout="HND", maxnreg=None, ks_ahead=False, l2_ahead=0, outs=None):
    from kvfit.kernels.decode_int4 import Int4DecodeConfig, int4_decode

    pool, tables = filled_pool(kv_lens, hkv, d, device, dtype, v_layout=v_layout)
    b = len(kv_lens)
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    width = max(len(t) for t in tables)
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    out = torch.full_like(q, float("nan"))  # poisoned
    sm = d ** -0.5
    int4_decode(q, pool, 0, bt.to(device), torch.tensor(kv_lens, dtype=torch.int32).to(device),
                torch.arange(b, dtype=torch.int32).to(device), out, sm,
                Int4DecodeConfig(num_splits, pages_per_tile, num_warps, num_stages, asm,
                                 maxnreg=maxnreg, fold_k=fold_k, ks_tokens=ks_tokens,
                                 gluon=gluon, ks_ahead=ks_ahead, l2_ahead=l2_ahead))
    want = reference(q, pool, tables, kv_lens, sm)
    got = out.double().cpu()
    if outs is not None:  # the caller keeps the output (bit comparisons between launches)
        outs.append(out)
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err < rtol, f"relative error {err:.2e} >= {rtol}"
    return float(err)
