"""The triton backend over the int4 pool against the torch reference backend, step by step: two
pools fed the same k/v through prefill, mixed and decode steps (chunks crossing pages, so pages
fill from residual slots), each backend's attention output compared. Shared by the CPU test
under the Triton interpreter (tests/test_int4_triton_backend.py) and the GPU test."""

from __future__ import annotations

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.torch_ref import TorchRefBackend
from kvfit.attention.triton_backend import TritonBackend
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.int4_pool import Int4KVCache
from kvfit.kvcache.spec import KVLayerSpec

# q_lens per step for three requests: prefill chunks, a mixed step, decode steps
STEPS = [[40, 5, 70], [1, 30, 1], [1, 1, 1], [1, 1, 1], [25, 1, 1], [1, 1, 1]]


def run_steps(device, dtype, hq=4, hkv=2, d=64, steps=STEPS, seed=0, v_layout="HND") -> float:
    """Largest relative difference of the triton backend's output from the reference's (the
    triton backend's pool stores V as ``v_layout`` says, the reference's token-major)."""
    g = torch.Generator().manual_seed(seed)
    b = len(steps[0])
    total = [sum(s[i] for s in steps) for i in range(b)]
    npages = [-(-n // 32) for n in total]
    perm = torch.randperm(sum(npages) + 2, generator=g).tolist()
    tables, at = [], 0
    for n in npages:
        tables.append(perm[at:at + n])
        at += n
    pools = [Int4KVCache([KVLayerSpec("full", hkv, d)], sum(npages) + 2, 32, kv_format("int4"),
                         device, num_slots=b + 1, residual_dtype=dtype, v_layout=layout)
             for layout in ("HND", v_layout)]
    slots = [b, 0, 2][:b] if b == 3 else list(range(b))  # not in request order
    ref = TorchRefBackend(pools[0], dtype, d ** -0.5)
    tri = TritonBackend(pools[1], dtype, d ** -0.5)
    done = [0] * b
    worst = 0.0
    for q_lens in steps:
        done = [x + q for x, q in zip(done, q_lens)]
        t = sum(q_lens)
        q = torch.randn(t, hq, d, generator=g).to(device, dtype)
        k = (torch.randn(t, hkv, d, generator=g) * 2
             + torch.linspace(-6, 6, d)[None, None, :]).to(device, dtype)
        v = torch.randn(t, hkv, d, generator=g).to(device, dtype)
        outs = []
        for backend in (ref, tri):
            meta = build_metadata(q_lens, done, tables, 32, device, residual_slots=slots)
            backend.prepare(meta)
            outs.append(backend.forward(q, k, v, 0).double().cpu())
        want, got = outs
        assert torch.isfinite(got).all(), q_lens
        err = float((got - want).abs().max() / want.abs().max())
        worst = max(worst, err)
    return worst
