"""--kv-dtype int4 (KIVI-style): the quantizer's bytes, the residual flush, slots, pricing, guard."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.bench.configs import config_path
from kvfit.config import EngineConfig
from kvfit.engine.guard import check_combination
from kvfit.errors import UnsupportedCombinationError
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
from kvfit.kvcache.int4_pool import Int4KVCache
from kvfit.kvcache.int4_residual import ResidualSlots
from kvfit.kvcache.kivi import (dequantize_k_page, dequantize_v_tokens, pack_nibbles,
                                quantize_k_page, quantize_v_tokens, unpack_nibbles)
from kvfit.kvcache.mla import MLAKVCache
from kvfit.kvcache.pool import MHAKVCache
from kvfit.kvcache.sizing import SizingLimits
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token
from kvfit.plan import parse_memory, plan_capacity
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import Request
from kvfit.scheduler.scheduler import Scheduler

INT4 = kv_format("int4")
CPU = torch.device("cpu")


def _reference_codes(x: np.ndarray, axis: int):
    """The contract's formula in numpy, written independently: float16 scale/zero over ``axis``,
    codes by round-half-even in float32."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = np.maximum((hi - lo) / np.float32(15), np.float32(2.0 ** -14)).astype(np.float16)
    zero = lo.astype(np.float16)
    q = np.clip(np.rint((x - zero.astype(np.float32)) / scale.astype(np.float32)), 0, 15)
    return q.astype(np.uint8), scale, zero


def test_pack_unpack_round_trip_low_nibble_is_even_channel():
    q = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 3, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[..., 0] & 0xF, q[..., 0]) and torch.equal(packed[..., 0] >> 4,
                                                                         q[..., 1])
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantizers_store_the_contract_bytes(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4, 2, 32, 64, generator=g) * 3 + torch.randn(1, 2, 1, 64, generator=g) * 40
    v = torch.randn(4, 2, 32, 64, generator=g)
    kp, ks, kz = quantize_k_page(k)
    q, s, z = _reference_codes(k.numpy(), axis=-2)
    assert torch.equal(unpack_nibbles(kp), torch.from_numpy(q))
    assert np.array_equal(ks.numpy(), s[..., 0, :]) and np.array_equal(kz.numpy(), z[..., 0, :])
    vp, vs, vz = quantize_v_tokens(v)
    q, s, z = _reference_codes(v.numpy().reshape(4, 2, 32, 2, 32), axis=-1)
    assert torch.equal(unpack_nibbles(vp), torch.from_numpy(q.reshape(4, 2, 32, 64)))
    assert np.array_equal(vs.numpy(), s[..., 0]) and np.array_equal(vz.numpy(), z[..., 0])
    # dequantized error within half a step (plus float16 rounding of scale and zero)
    for x, deq, scale in ((k, dequantize_k_page(kp, ks, kz, torch.float32), ks.float()[..., None, :]),
                          (v, dequantize_v_tokens(vp, vs, vz, torch.float32),
                           vs.float().repeat_interleave(32, -1))):
        err = (deq - x).abs()
        assert (err <= 0.5 * scale + 0.02 * scale + 1e-3 * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_saturation_no_nan_inf_scales_never_zero(dtype):
    big = torch.finfo(dtype).max
    x = torch.randn(3, 1, 32, 64).to(dtype)
    x[0, 0, 0, :] = big  # a range far beyond float16's
    x[0, 0, 1, :] = -big
    x[1] = 7.25  # constant groups: range 0
    x[2, 0, :, :32] = 1e-30  # subnormal-scale ranges
    for qz in (quantize_k_page, quantize_v_tokens):
        packed, scale, zero = qz(x)
        assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
        assert (scale.float() >= 2.0 ** -14).all()
        deq = (dequantize_k_page if qz is quantize_k_page else dequantize_v_tokens)(
            packed, scale, zero, torch.float32)
        assert torch.isfinite(deq).all()
        assert torch.equal(deq[1], torch.full_like(deq[1], 7.25))  # exact for a constant group


def _layers(n=2, h=2, d=64):
    return [KVLayerSpec("full", h, d) for _ in range(n)]


def _store_and_gather(pool, steps, slots, n_req, dtype=torch.float32):
    """Run ``steps`` (lists of (request, n_new)) through store_step with random k/v; returns
    the k/v written per request (float32 truth) and the pool."""
    g = torch.Generator().manual_seed(7)
    truth = {r: ([], []) for r in range(n_req)}
    done = {r: 0 for r in range(n_req)}
    tables = {r: [] for r in range(n_req)}
    free = list(range(pool.num_pages))
    spec = pool.layers[0]
    for step in steps:
        q_lens, kv_lens, tabs, sl = [], [], [], []
        for r, n in step:
            done[r] += n
            while len(tables[r]) * pool.page_size < done[r]:
                tables[r].append(free.pop(0))
            q_lens.append(n)
            kv_lens.append(done[r])
            tabs.append(tables[r])
            sl.append(slots[r])
        t = sum(q_lens)
        k = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g).to(dtype)
        v = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g).to(dtype)
        meta = build_metadata(q_lens, kv_lens, tabs, pool.page_size, CPU, residual_slots=sl)
        for layer in range(pool.num_layers):
            pool.store_step(layer, k, v, meta.residual)
        off = 0
        for r, n in step:
            truth[r][0].append(k[off:off + n])
            truth[r][1].append(v[off:off + n])
            off += n
    return {r: (torch.cat(a), torch.cat(b)) for r, (a, b) in truth.items()}, tables, done


def test_residual_flush_equals_quantizing_full_pages():
    """Requests growing by chunks of every size (decode steps, chunks crossing pages, pages
    completed from the residual) read back exactly what quantizing their full pages at once
    gives, and their last partial page unquantized."""
    pool = Int4KVCache(_layers(), 120, 32, INT4, CPU, num_slots=3)
    rng = random.Random(3)
    steps = []
    for _ in range(14):  # mixed batches: three requests, random chunk sizes
        steps.append([(r, rng.choice([1, 1, 5, 31, 32, 33, 70])) for r in range(3)
                      if rng.random() < 0.8])
    slots = {0: 2, 1: 0, 2: 1}
    truth, tables, done = _store_and_gather(pool, steps, slots, 3)
    for r in range(3):
        n = done[r]
        assert n > 64
        k, v = truth[r]
        nfull = n // 32 * 32
        kpage = k[:nfull].unflatten(0, (-1, 32)).transpose(1, 2)  # [n, P, H, D] -> [n, H, P, D]
        vpage = v[:nfull].unflatten(0, (-1, 32)).transpose(1, 2)
        want_k = dequantize_k_page(*quantize_k_page(kpage), torch.float32)
        want_v = dequantize_v_tokens(*quantize_v_tokens(vpage), torch.float32)
        for layer in range(2):
            gk, gv = pool.gather_kv(layer, torch.tensor(tables[r]), n, torch.float32,
                                    residual_slot=slots[r])
            assert gk.shape == (n, 2, 64)
            assert torch.equal(gk[:nfull], want_k.transpose(1, 2).reshape(-1, 2, 64))
            assert torch.equal(gv[:nfull], want_v.transpose(1, 2).reshape(-1, 2, 64))
            assert torch.equal(gk[nfull:], k[nfull:]) and torch.equal(gv[nfull:], v[nfull:])


def test_padding_rows_store_nothing():
    pool = Int4KVCache(_layers(1), 4, 32, INT4, CPU, num_slots=2)
    for t in (*pool.k_residual, *pool.k_caches):
        t.fill_(0)
    meta = build_metadata([1, 1], [1, 40], [[0], [1, 2]], 32, CPU, num_real_reqs=1,
                          residual_slots=[0, 1])
    pool.store_step(0, torch.ones(2, 2, 64), torch.ones(2, 2, 64), meta.residual)
    assert meta.residual.num_full_pages == 0
    assert pool.k_residual[0][0, :, 0].eq(1).all() and pool.k_residual[0][1].eq(0).all()


def test_residual_slots_assign_release_reuse():
    slots = ResidualSlots(2)
    a = slots.assign("a")
    assert slots.assign("a") == a and slots.can_assign("b")
    b = slots.assign("b")
    assert {a, b} == {0, 1} and not slots.can_assign("c") and slots.can_assign("a")
    with pytest.raises(RuntimeError, match="no free residual slot"):
        slots.assign("c")
    slots.release("a")
    slots.release("a")  # idempotent
    assert slots.assign("c") == a and slots.num_free == 0
    with pytest.raises(KeyError, match="holds no residual slot"):
        slots.slot("a")


def test_scheduler_gives_slots_with_pages_and_takes_them_back():
    """Admission assigns a slot, preemption and finish release it; nothing leaks."""
    slots = ResidualSlots(2)
    alloc = PageAllocator(4)
    sched = Scheduler(alloc, 32, 2, 256, residual=slots)
    reqs = [Request(str(i), None, list(range(40)), SamplingParams(max_tokens=60), 0, i)
            for i in range(2)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert len(batch.items) == 2 and slots.num_free == 0
    assert slots.slot("0") != slots.slot("1")
    for r, n in batch.items:
        r.num_computed_tokens += n
    for r in reqs:  # grow both past their pages: the newest is preempted, its slot released
        r.output_token_ids += [1] * 30
    batch = sched.schedule()
    assert [r.request_id for r in batch.preempted] == ["1"]
    assert not slots.holds("1") and slots.holds("0") and slots.num_free == 1
    sched.finish(reqs[0], "stop")
    sched.finish(reqs[1], "abort")
    assert slots.num_free == 2 and alloc.num_free == 4


def test_price_is_0_625_bytes_per_element_and_the_pool_allocates_it():
    layers = _layers(3, 2, 128)
    assert spec_kv_bytes_per_token(layers, INT4) * 8 == 5 * 3 * 2 * 2 * 128
    for budget, seqs, dtype in ((10 << 20, 4, torch.bfloat16), (3 << 20, 2, torch.float32)):
        sizing = Int4KVCache.solve_pages(layers, INT4, 32, SizingLimits(budget, max_num_seqs=seqs,
                                                                       compute_dtype=dtype))
        pool = Int4KVCache.from_sizing(sizing, layers, INT4, torch.device("meta"))
        assert pool.allocated_bytes() == pool.priced_bytes() == sizing.pool_bytes <= budget
        page = 32 * spec_kv_bytes_per_token(layers, INT4)
        assert budget - sizing.pool_bytes < page  # the most pages that fit
        assert pool.residual_slots.num_slots == seqs and pool.k_residual[0].dtype == dtype
        assert "residual buffer" in sizing.capacity_line(INT4, 1024)


def test_plan_int4_tokens_against_bf16_at_the_same_bytes():
    """Qwen3-1.7B: int4 pages cost 5/16 of bf16's; the residual (one bf16 page per running
    request) is the only difference from 3.2x, and it is priced."""
    mem = parse_memory("40GiB")
    rows = plan_capacity(EngineConfig(model=config_path("qwen3-1.7b"), max_num_seqs=64), mem,
                         ["bfloat16", "int4"])
    bf16, int4 = [r.sizing for r in rows]
    assert int4.page_size == 32 and rows[1].settings.pool_cls is Int4KVCache
    assert int4.bytes_per_token * 16 == bf16.bytes_per_token * 5
    assert int4.residual_bytes == 64 * 32 * bf16.bytes_per_token
    assert int4.tokens / bf16.tokens >= 3.18
    pages = (mem - int4.residual_bytes) // (32 * int4.bytes_per_token)
    assert int4.num_pages == pages


def test_guard_int4_needs_its_pool_pages_of_32_and_a_backend_that_reads_it():
    layers = [KVLayerSpec("full", 2, 64)]
    check_combination("torch", Int4KVCache, INT4, 32, "cpu", layers)
    with pytest.raises(UnsupportedCombinationError, match="needs pages of 32 tokens.*--page-size 32"):
        check_combination("torch", Int4KVCache, INT4, 16, "cpu", layers)
    check_combination("triton", Int4KVCache, INT4, 32, "cuda", layers, assume_installed=True)
    for d in (64, 128, 256):
        check_combination("triton", Int4KVCache, INT4, 32, "cuda", [KVLayerSpec("full", 2, d)],
                          assume_installed=True)
    with pytest.raises(UnsupportedCombinationError,
                       match="fi does not read int4.*runs on --attention-backend triton.*"
                             "these backends support it: torch, triton"):
        check_combination("fi", Int4KVCache, INT4, 32, "cuda", layers, assume_installed=True)
    with pytest.raises(UnsupportedCombinationError, match="triton runs on cuda, not cpu"):
        check_combination("triton", Int4KVCache, INT4, 32, "cpu", layers)
    for pool in (MHAKVCache, HybridSWAKVCache, MLAKVCache):
        with pytest.raises(UnsupportedCombinationError, match=f"{pool.name} pool does not store int4"):
            check_combination("torch", pool, INT4, 32, "cpu", layers)


def test_settings_pick_the_int4_pool_and_pages_of_32(tiny_models):
    from kvfit.engine.settings import resolve_settings

    s = resolve_settings(EngineConfig(model=tiny_models["qwen3"][0], device="cpu",
                                      kv_dtype="int4"))
    assert s.pool_cls is Int4KVCache and s.page_size == 32 and s.backend_name == "torch"
    with pytest.raises(UnsupportedCombinationError, match="needs pages of 32"):
        resolve_settings(EngineConfig(model=tiny_models["qwen3"][0], device="cpu",
                                      kv_dtype="int4", page_size=16))
