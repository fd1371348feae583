"""``kvfit plan`` agrees with the engine's start-up line on the GPU, to the token, for every
backend and KV dtype: the engine measures its budget (memory ratio x free memory - weights -
activations), and the plan of that same budget prints the same line (on a CUDA host the plan
resolves ``auto`` exactly as the engine here does)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytestmark = pytest.mark.gpu

# a Qwen3-shaped model with heads of 128, where auto picks triton for fp8 (pages of 32)
CFG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=512,
           intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=4096,
           rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, torch_dtype="bfloat16")


@pytest.mark.parametrize("backend", ["auto", "triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_plan_matches_the_engine_line(tmp_path, caplog, backend, kv_dtype):
    from kvfit.attention.registry import unavailable_reason
    from kvfit.config import EngineConfig
    from kvfit.engine.runner import ModelRunner
    from kvfit.plan import plan_capacity

    if backend != "auto" and unavailable_reason(backend, "cuda"):
        pytest.skip(unavailable_reason(backend, "cuda"))
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    model = str(tmp_path / "config.json")
    caplog.set_level(logging.INFO, logger="kvfit")
    cfg = EngineConfig(model=model, load_format="dummy", device="cuda", kv_dtype=kv_dtype,
                       attention_backend=backend, memory_ratio=0.05, enforce_eager=True)
    runner = ModelRunner(cfg)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    (row,) = plan_capacity(EngineConfig(model=model, attention_backend=backend),
                           runner.kv_budget_bytes, [kv_dtype], device="cuda")
    assert row.settings.backend_name == runner.backend_name
    assert row.settings.page_size == runner.config.page_size
    assert line == [row.capacity_line()]
    assert runner.pool.allocated_bytes() == runner.pool.priced_bytes() <= runner.kv_budget_bytes
    del runner
    torch.cuda.empty_cache()
