"""HybridSWAKVCache: sliding page lists release pages as the window slides and never exceed the
worst-case reservation; the price list splits a budget between full and sliding layers (to the
byte); fp8 stores saturate (no NaN) and stay within a documented tolerance of bf16; the guard
accepts what is implemented and refuses the rest."""

from __future__ import annotations

import random

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.torch_ref import TorchRefBackend
from kvfit.kvcache.allocator import OutOfPages
from kvfit.kvcache.dtypes import KV_FORMATS, kv_format
from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
from kvfit.kvcache.sizing import (SizingLimits, hybrid_pool_bytes, sliding_pages_worst_case,
                                  solve_hybrid_pages)
from kvfit.kvcache.sliding_pages import SlidingWindowPages
from kvfit.kvcache.registry import resolve_pool_class
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token

CPU = torch.device("cpu")


def _gemma_layers(n=6, window=8, heads=2, hd=16):
    return [KVLayerSpec("full" if (i + 1) % 6 == 0 else "sliding", heads, hd,
                        None if (i + 1) % 6 == 0 else window) for i in range(n)]


def test_pages_released_as_window_slides_and_all_freed():
    sw = SlidingWindowPages(num_pages=20, page_size=4, window=8)
    sw.reserve("a", 0, 13)  # prefill 13 tokens: pages for positions 0..12
    assert sw.table("a") == [0, 1, 2, 3] and sw.num_used == 4
    assert sw.release("a", 13) == 1  # next query at 13 sees 6..13: page 0 (0..3) is dead
    assert sw.table("a")[0] == -1
    used = []
    for pos in range(13, 60):  # decode
        sw.reserve("a", pos, pos + 1)
        used.append(sw.num_used)
        sw.release("a", pos + 1)
    assert max(used) <= -(-7 // 4) + 2  # ceil((W-1)/P) + 2 pages, whatever the length
    table = sw.table("a")
    assert len(table) == 15 and table[:12] == [-1] * 12
    sw.free("a")
    assert sw.num_used == 0 and sw.table("a") == []


def test_worst_case_reservation_holds_random_schedules():
    rng = random.Random(0)
    page, window, max_seqs, max_tokens = 4, 9, 3, 12
    n = sliding_pages_worst_case(window, page, max_seqs, max_tokens)
    sw = SlidingWindowPages(n, page, window)
    lens = {f"r{i}": rng.randint(5, 60) for i in range(8)}
    done = {r: 0 for r in lens}
    running: list[str] = []
    waiting = list(lens)
    while running or waiting:
        while waiting and len(running) < max_seqs:
            running.append(waiting.pop(0))
        budget = max_tokens
        for r in list(running):
            k = min(lens[r] - done[r], budget, rng.randint(1, max_tokens))
            if k <= 0:
                continue
            sw.reserve(r, done[r], done[r] + k)  # must never raise OutOfPages
            budget -= k
            done[r] += k
        for r in list(running):
            if done[r] == lens[r]:
                running.remove(r)
                sw.free(r)
            elif rng.random() < 0.5:  # release after the step is optional
                sw.release(r, done[r])
    assert sw.num_used == 0
    tiny = SlidingWindowPages(2, page, window)
    assert not tiny.can_reserve("x", 0, 20)
    with pytest.raises(OutOfPages, match="sliding-window pages exhausted"):
        tiny.reserve("x", 0, 20)
    small = SlidingWindowPages(3, page, window)
    small.reserve("y", 0, 12)  # all 3 pages
    assert not small.can_reserve("y", 11, 13)  # a query at 11 still sees page 0 (3..11)
    assert small.can_reserve("y", 12, 13)  # a query at 12 sees 4..12: page 0 is released first
    small.reserve("y", 12, 13)
    assert small.table("y")[0] == -1 and small.num_used == 3


def test_capped_reservation_and_can_reserve_admission():
    """A budget too small for max_num_seqs windows: the sliding share is capped, can_reserve
    limits concurrency, and every page comes back."""
    layers = _gemma_layers(window=8)
    fmt = kv_format("bfloat16")
    swa_bpt = spec_kv_bytes_per_token(layers, fmt, kinds=("sliding",))
    budget = 40 * 4 * swa_bpt
    plan = solve_hybrid_pages(budget, layers, fmt, 4, max_num_seqs=64, max_num_batched_tokens=8)
    assert plan.num_swa_pages < sliding_pages_worst_case(8, 4, 64, 8)
    assert plan.pool_bytes <= budget and plan.num_pages > 0
    sw = SlidingWindowPages(plan.num_swa_pages, 4, 8)
    admitted = []
    for i in range(64):  # admit while the first chunk fits, then decode all past the window
        if not sw.can_reserve(str(i), 0, 8):
            break
        sw.reserve(str(i), 0, 8)
        admitted.append(str(i))
    assert 1 <= len(admitted) < 64
    for pos in range(8, 40):  # decode; preempt the last admitted when a page is missing
        for r in list(admitted):
            if r not in admitted:
                continue
            while not sw.can_reserve(r, pos, pos + 1):
                victim = admitted.pop()
                sw.free(victim)
                if victim == r:
                    break
            if r in admitted:
                sw.reserve(r, pos, pos + 1)
    assert len(admitted) >= max(1, plan.window_requests - 1)
    for r in admitted:
        sw.free(r)
    assert sw.num_used == 0


def test_pool_layout_price_and_selection():
    layers = _gemma_layers()
    assert resolve_pool_class(layers) is HybridSWAKVCache
    for name in ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"):
        fmt = kv_format(name)
        pool = HybridSWAKVCache(layers, 10, 4, fmt, CPU, num_swa_pages=7)
        assert pool.k_caches[0].shape == (8, 2, 4, 16)  # sliding: 7 pages + the null page
        assert pool.k_caches[5].shape == (10, 2, 4, 16)  # full
        assert pool.allocated_bytes() == pool.priced_bytes() == hybrid_pool_bytes(
            layers, fmt, 4, 10, 7)
        assert (pool.k_caches[0][pool.null_page].float() == 0).all()
    shared = HybridSWAKVCache(layers, 10, 4, kv_format("bfloat16"), CPU)  # no own page space
    assert shared.sliding_pages is None
    assert shared.k_caches[0].shape == (10, 2, 4, 16)
    assert shared.allocated_bytes() == shared.priced_bytes() == 40 * spec_kv_bytes_per_token(
        layers, kv_format("bfloat16"))
    with pytest.raises(ValueError, match="num_swa_pages"):
        HybridSWAKVCache(layers, 10, 4, kv_format("bfloat16"), CPU, num_swa_pages=0)


def _gemma3_270m_cfg():
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        max_position_embeddings=32768)


def test_solve_hybrid_pages_splits_budget():
    from kvfit.errors import KVBudgetError
    from kvfit.models.gemma3 import Gemma3ForCausalLM

    layers = Gemma3ForCausalLM.kv_layer_specs(_gemma3_270m_cfg())
    assert [l.kind for l in layers].count("full") == 3
    budget = 2 << 30
    plans = {}
    for name in ("bfloat16", "fp8_e4m3"):
        fmt = kv_format(name)
        plan = solve_hybrid_pages(budget, layers, fmt, 16, max_num_seqs=64,
                                  max_num_batched_tokens=2048)
        plans[name] = plan
        assert plan.bytes_per_token == 3 * 2 * 256 * fmt.itemsize
        assert plan.swa_bytes_per_token == 15 * 2 * 256 * fmt.itemsize
        assert plan.num_swa_pages == 64 * (32 + 2) + 128  # 2 GiB: the worst case fits
        assert plan.pool_bytes <= budget < plan.pool_bytes + 16 * plan.bytes_per_token
        assert plan.pool_bytes == hybrid_pool_bytes(layers, fmt, 16, plan.num_pages,
                                                    plan.num_swa_pages)
        line = plan.capacity_line(fmt, 32768)
        assert f"{plan.tokens:,} tokens" in line and "3 full layers" in line
        # the pool class sizes itself the same way, and builds what it priced
        limits = SizingLimits(budget, max_num_seqs=64, max_num_batched_tokens=2048)
        assert HybridSWAKVCache.solve_pages(layers, fmt, 16, limits) == plan
    # fp8 halves both costs: the full layers hold (a little more than, the reservation halves
    # too) twice the tokens for the same bytes
    assert plans["fp8_e4m3"].tokens >= 2 * plans["bfloat16"].tokens
    with pytest.raises(KVBudgetError, match="max-num-batched-tokens"):
        solve_hybrid_pages(1 << 20, layers, kv_format("bfloat16"), 16, 64, 2048)
    fixed = solve_hybrid_pages(0, layers, kv_format("bfloat16"), 16, 4, 64, num_pages=123)
    assert fixed.num_pages == 123


@pytest.mark.parametrize("name,tol", [("bfloat16", 2 ** -8), ("fp8_e4m3", 2 ** -4),
                                      ("fp8_e5m2", 2 ** -3)])
def test_store_saturates_and_rounds(name, tol):
    fmt = kv_format(name)
    layers = _gemma_layers()
    scaled = fmt.quantized  # NOTE: quant.quantize ignores scales for unquantized formats
    pool = HybridSWAKVCache(layers, 6, 4, fmt, CPU, num_swa_pages=5,
                            k_scales=[0.5, 1, 2, 1, 1, 4] if scaled else None,
                            v_scales=[1, 1, 1, 1, 2, 0.25] if scaled else None)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(10, 2, 16, generator=g) * 30
    v = torch.randn(10, 2, 16, generator=g) * 30
    k[0, 0, :2] = torch.tensor([1e7, -1e7])
    v[1, 1, :2] = torch.tensor([1e7, -1e7])
    slots = torch.arange(10) + 2  # pages 0..2, offset 2
    for layer in range(6):
        pool.k_caches[layer].fill_(float("nan"))  # poison
        pool.v_caches[layer].fill_(float("nan"))
        pool.store_kv(layer, k.clone(), v.clone(), slots)
        gk, gv = pool.gather_kv(layer, torch.tensor([0, 1, 2]), 12, torch.float32)
        for got, x, scale in ((gk[2:], k, pool.k_scales[layer]), (gv[2:], v, pool.v_scales[layer])):
            assert torch.isfinite(got).all()
            lim = fmt.max_finite * scale
            ref = x.clamp(-lim, lim)
            sub = torch.finfo(fmt.torch_dtype).smallest_normal * scale
            assert ((got - ref).abs() <= tol * ref.abs() + sub).all()
        if fmt.quantized:
            assert gk[2, 0, 0] == fmt.max_finite * pool.k_scales[layer]


def test_fp8_model_close_to_bf16():
    """Documented tolerance (tiny random Gemma 3, prompt past the window, 10 decode steps): with
    fp8_e4m3 (e5m2) K/V the logits stay within 5% (10%) of the bf16-cache logits' scale."""
    from modelhelpers import chunked_schedule
    from test_gemma3 import _hf_and_ours, drive_hybrid

    cfg, _, ours = _hf_and_ours("gemma3", seed=3)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, cfg.vocab_size, (n + 10,), generator=g).tolist() for n in (12, 9)]
    sched = chunked_schedule([12, 9], 5, 10)
    base, *_ = drive_hybrid(ours, cfg, seqs, sched, kv_dtype="bfloat16")
    for name, tol in (("fp8_e4m3", 0.05), ("fp8_e5m2", 0.10)):
        got, pool, *_ = drive_hybrid(ours, cfg, seqs, sched, kv_dtype=name)
        for b, q in zip(base, got):
            assert torch.isfinite(q).all()
            rel = ((q - b).abs().max() / b.abs().max()).item()
            assert rel < tol, f"{name}: rel {rel:.3f}"


def test_backend_needs_hybrid_metadata():
    layers = _gemma_layers()
    pool = HybridSWAKVCache(layers, 4, 4, kv_format("bfloat16"), CPU, num_swa_pages=4)
    be = TorchRefBackend(pool, torch.float32, 0.25)
    be.prepare(build_metadata([3], [3], [[0]], 4, CPU))
    q = torch.randn(3, 4, 16)
    k = torch.randn(3, 2, 16)
    with pytest.raises(RuntimeError, match="build_step_metadata"):
        be.forward(q, k, k, 0)


def test_guard_accepts_implemented_and_refuses_the_rest():
    from kvfit.attention.registry import BACKENDS, unavailable_reason, backend_class
    from kvfit.engine.guard import check_combination
    from kvfit.errors import UnsupportedCombinationError

    layers = _gemma_layers()
    for name, fmt in KV_FORMATS.items():
        if name == "float32":
            continue
        if fmt.scale_mode == "kivi":  # int4 has a pool of its own, for full-attention models
            with pytest.raises(UnsupportedCombinationError,
                               match="HybridSWAKVCache pool does not store int4"):
                check_combination("torch", HybridSWAKVCache, fmt, 32, "cpu", layers)
            continue
        check_combination("torch", HybridSWAKVCache, kv_format(name), 16, "cpu", layers)
    for backend in BACKENDS:
        if backend == "torch":
            continue
        ok = (unavailable_reason(backend, "cuda") is None
              and "HybridSWAKVCache" in backend_class(backend).pools)
        if ok:
            continue  # declared and available: covered by that backend's GPU tests
        with pytest.raises(UnsupportedCombinationError, match="HybridSWAKVCache|not available"):
            check_combination(backend, HybridSWAKVCache, kv_format("fp8_e4m3"), 16, "cuda",
                              layers)
