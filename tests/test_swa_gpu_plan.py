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
