"""The triton backend over a windowed HybridSWAKVCache against the torch reference backend, one
attention step at a time (shared by the CPU interpreter test and the GPU test).

``run_case`` drives two identical pools (one per backend) through a schedule of chunked prefill
and decode steps: the sliding page lists reserve and release pages as the window slides, as the
scheduler does, so steps read through freed entries (the null page) and prompts cross the window
edge. Each step feeds the same fresh random q/k/v to a sliding and a full layer of both backends
and returns the largest error relative to the reference output's scale.
"""

from __future__ import annotations

import torch

from kvfit.attention.meta_builder import build_step_metadata
from kvfit.attention.torch_ref import TorchRefBackend
from kvfit.attention.triton_backend import TritonBackend
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
from kvfit.kvcache.spec import KVLayerSpec


def poison_pool(pool: HybridSWAKVCache) -> None:
    """NaN in every slot (0x7F bytes are NaN in both fp8 formats; int8 pools: NaN scales); the
    sliding null page zero, as the pool keeps it. A kernel reading an unwritten slot outside its
    masks shows NaN."""
    scales = list(zip(getattr(pool, "k_scale_caches", None) or [],
                      getattr(pool, "v_scale_caches", None) or []))
    for i, (spec, kc, vc) in enumerate(zip(pool.layers, pool.k_caches, pool.v_caches)):
        for c in (kc, vc, *(scales[i] if scales else ())):  # int8: the scale pages too
            if c.element_size() == 1:
                c.view(torch.uint8).fill_(0x7F)
            else:
                c.fill_(float("nan"))
            if spec.kind == "sliding":
                c[pool.null_page] = 0


def run_case(device, kv_dtype: str, compute_dtype: torch.dtype, page_size: int, window: int,
             schedule, hq: int = 2, hkv: int = 1, head_dim: int = 64, v_layout: str = "HND",
             softcap: float | None = None, store_with_pool: bool = False, seed: int = 0
             ) -> list[float]:
    """Per step, max |triton - torch| / max |torch| over both layers' outputs.

    ``schedule``: steps of (request index, new tokens). ``store_with_pool``: K/V are stored by the
    pool's torch store for both backends and the triton backend is called with ``kv_stored``
    (tests the read path alone where the store kernel cannot run bit-exactly, e.g. fp8 under
    the Triton interpreter)."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    layers = [KVLayerSpec("sliding", hkv, head_dim, window), KVLayerSpec("full", hkv, head_dim)]
    n_req = 1 + max(r for step in schedule for r, _ in step)
    longest = [0] * n_req
    for step in schedule:
        for r, n in step:
            longest[r] += n
    num_pages = sum(-(-n // page_size) for n in longest) + 1
    num_swa = n_req * (-(-window // page_size) + 2) + sum(-(-n // page_size)
                                                          for _, n in schedule[0]) + 4
    pools = [HybridSWAKVCache(layers, num_pages, page_size, kv_format(kv_dtype), device,
                              num_swa_pages=num_swa, v_layout=v_layout) for _ in range(2)]
    for p in pools:
        poison_pool(p)
    sm = head_dim ** -0.5
    ref = TorchRefBackend(pools[0], compute_dtype, sm, softcap)
    tri = TritonBackend(pools[1], compute_dtype, sm, softcap)
    allocs = [PageAllocator(num_pages) for _ in range(2)]
    pages = [[[] for _ in range(n_req)] for _ in range(2)]
    done = [0] * n_req
    errors = []
    for step in schedule:
        q_lens, kv_lens, rids = [], [], []
        for r, n in step:
            s, e = done[r], done[r] + n
            for j in range(2):
                need = -(-e // page_size) - len(pages[j][r])
                pages[j][r] += allocs[j].allocate(max(0, need))
                pools[j].sliding_pages.reserve(str(r), s, e)
            q_lens.append(n)
            kv_lens.append(e)
            rids.append(str(r))
            done[r] = e
        t = sum(q_lens)
        q = torch.randn(t, hq, head_dim, generator=g).to(device, compute_dtype)
        k = torch.randn(t, hkv, head_dim, generator=g).to(device, compute_dtype)
        v = torch.randn(t, hkv, head_dim, generator=g).to(device, compute_dtype)
        outs = []
        for j, be in enumerate((ref, tri)):
            meta = build_step_metadata(pools[j], q_lens, kv_lens,
                                       [pages[j][r] for r, _ in step], rids, device)
            be.prepare(meta)
            layer_out = []
            for layer in range(2):
                if j == 1 and store_with_pool:
                    table = meta.swa if layers[layer].kind == "sliding" else meta
                    pools[1].store_kv(layer, k, v, table.slot_mapping)
                    layer_out.append(be.forward(q, k, v, layer, kv_stored=True))
                else:
                    layer_out.append(be.forward(q, k, v, layer))
            outs.append(layer_out)
        err = 0.0
        for a, b in zip(*outs):
            assert torch.isfinite(b).all(), "triton output has NaN/Inf (read an unwritten slot?)"
            err = max(err, ((b.float() - a.float()).abs().max() / a.float().abs().max()).item())
        errors.append(err)
        for j in range(2):  # release after the step, as the scheduler may
            for r, _ in step:
                pools[j].sliding_pages.release(str(r), done[r])
    return errors


def window_schedule(prompts: list[int], chunk: int, decode_steps: int):
    """Chunked prefill of every prompt together, then decode steps of one token each."""
    steps, done = [], [0] * len(prompts)
    while any(d < p for d, p in zip(done, prompts)):
        step = []
        for r, p in enumerate(prompts):
            if done[r] < p:
                n = min(chunk, p - done[r])
                step.append((r, n))
                done[r] += n
        steps.append(step)
    return steps + [[(r, 1) for r in range(len(prompts))] for _ in range(decode_steps)]
