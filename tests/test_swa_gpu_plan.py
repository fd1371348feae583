"""Gemma 3 (the hybrid sliding-window pool) planned for CUDA from a CPU host: ``auto`` picks the
triton backend (FlashInfer does not hold the pool), which takes every KV format with its usual
page size and V layout; naming ``fi`` is refused at start with a message that names triton."""

from __future__ import annotations

import pytest
import torch

from kvfit.bench.configs import config_path
from kvfit.config import EngineConfig
from kvfit.errors import UnsupportedCombinationError
from kvfit.plan import parse_memory, plan_capacity

GEMMA = config_path("gemma3-4b")
CPU_HOST = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="plans for CUDA from a host without it")


@CPU_HOST
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_gemma3_plans_triton_on_cuda(kv_dtype):
    (row,) = plan_capacity(EngineConfig(model=GEMMA), parse_memory("4GiB"), [kv_dtype],
                           device="cuda")
    s = row.settings
    fp8 = kv_dtype.startswith("fp8")
    assert s.backend_name == "triton" and s.pool_cls.name == "HybridSWAKVCache"
    assert s.page_size == (32 if fp8 else 16)
    assert s.v_layout == ("HDN" if fp8 else "HND")
    assert row.sizing.num_swa_pages > 0 and row.sizing.tokens > 0


@CPU_HOST
def test_gemma3_refuses_fi_naming_triton():
    with pytest.raises(UnsupportedCombinationError, match="HybridSWAKVCache.*triton"):
        plan_capacity(EngineConfig(model=GEMMA, attention_backend="fi"), parse_memory("4GiB"),
                      ["bfloat16"], device="cuda")


def test_seed_bench_sliding_tables_hold_only_the_window():
    """``kvfit bench seed`` on a hybrid pool: decode requests at 16k context hold only their
    window's sliding pages (reserved in prefill chunks, as the scheduler would), within the
    pool's worst-case reservation, and give them all back."""
    from kvfit.attention.meta_builder import build_step_metadata
    from kvfit.bench.seed_points import free_sliding, sliding_tables
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
    from kvfit.kvcache.sizing import solve_hybrid_pages
    from kvfit.kvcache.spec import KVLayerSpec

    layers = [KVLayerSpec("sliding", 1, 8, 512)] * 5 + [KVLayerSpec("full", 1, 8)]
    ps, b, ctx, budget = 16, 16, 16384, 4096
    fmt = kv_format("bfloat16")
    sizing = solve_hybrid_pages(0, layers, fmt, ps, b, budget, num_pages=b * (ctx // ps + 8))
    pool = HybridSWAKVCache.from_sizing(sizing, layers, fmt, torch.device("cpu"))
    rids = [f"r{i}" for i in range(b)]
    swa = sliding_tables(pool, rids, ctx, ctx + 20, budget)
    live = -(-(ctx + 20) // ps) - (ctx - 511) // ps  # pages from the window's first token on
    assert pool.sliding_pages.num_used == b * live <= sizing.num_swa_pages
    per = -(-(ctx + 20) // ps)
    meta = build_step_metadata(pool, [1] * b, [ctx + 1] * b,
                               [list(range(i * per, (i + 1) * per)) for i in range(b)], rids,
                               torch.device("cpu"))
    assert meta.swa.first_live_cpu == [(ctx - 511) // ps] * b
    assert all(t[0] == -1 and t[-1] >= 0 for t in swa)
    free_sliding(pool, rids)
    assert pool.sliding_pages.num_used == 0


def test_auto_backend_skips_backends_without_the_head_size():
    """``auto`` picks only a backend that takes the model's heads: 16-d heads on the hybrid pool
    fall back to torch instead of failing in the guard."""
    from kvfit.attention.registry import select_backend

    assert select_backend("auto", "cuda", "HybridSWAKVCache", "bfloat16", 256,
                          assume_installed=True) == "triton"
    assert select_backend("auto", "cuda", "HybridSWAKVCache", "bfloat16", 16,
                          assume_installed=True) == "torch"
    assert select_backend("auto", "cuda", "MHAKVCache", "bfloat16", 96,
                          assume_installed=True) == "torch"
