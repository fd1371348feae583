"""Settings resolved once (engine/settings.py) and ``kvfit plan`` agreeing with the engine: on CPU
the engine's start-up capacity line and the plan's are the same line for every pool kind; for the
CUDA backends (planned from this CPU host) the plan prices the page size each backend chooses,
with the price list's bytes per token. Plus the one request-length check."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch

from kvfit.bench.configs import config_path
from kvfit.cli import main as cli_main
from kvfit.config import EngineConfig
from kvfit.engine.request_check import check_request
from kvfit.engine.settings import resolve_settings
from kvfit.errors import RequestRejected, UnsupportedCombinationError
from kvfit.kvcache.spec import spec_kv_bytes_per_token
from kvfit.plan import parse_memory, plan_capacity

QWEN3 = config_path("qwen3-1.7b")  # head_dim 128, 8 KV heads, 28 layers
GiB = 1 << 30


def _config_json(tmp_path, kind: str) -> str:
    """A config.json of a tiny model of each pool kind (random weights: --load-format dummy)."""
    if kind == "mha":
        from modelhelpers import TINY
        from transformers import CONFIG_MAPPING

        kw = dict(TINY["qwen3"])
        cfg = CONFIG_MAPPING[kw.pop("model_type")](**kw)
    elif kind == "hybrid":
        from test_gemma3 import _tiny_cfg

        cfg = _tiny_cfg("gemma3")
    else:
        from test_mla import _tiny_cfg

        cfg = _tiny_cfg("lite")
    d = tmp_path / kind
    cfg.save_pretrained(str(d))
    return str(d / "config.json")


@pytest.mark.parametrize("kind", ["mha", "hybrid", "mla"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_plan_prints_the_engines_capacity_line_on_cpu(tmp_path, caplog, kind, kv_dtype):
    from kvfit.engine.runner import ModelRunner

    model = _config_json(tmp_path, kind)
    space = 0.0123  # GiB: below free RAM, so the CPU budget is exactly this
    caplog.set_level(logging.INFO, logger="kvfit")
    runner = ModelRunner(EngineConfig(model=model, load_format="dummy", device="cpu",
                                      attention_backend="torch", kv_dtype=kv_dtype,
                                      cpu_kv_space_gib=space))
    engine_lines = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("KV cache:")]
    assert len(engine_lines) == 1
    mem = parse_memory(f"{space}GiB")
    (row,) = plan_capacity(EngineConfig(model=model, attention_backend="torch"), mem,
                           [kv_dtype], device="cpu")
    assert row.capacity_line() == engine_lines[0]  # same tokens, pages, GiB, concurrency
    assert runner.kv_budget_bytes == mem
    assert row.sizing == runner.sizing and row.settings.page_size == runner.config.page_size
    assert runner.pool.num_pages == row.sizing.num_pages
    assert runner.pool.priced_bytes() == runner.pool.allocated_bytes() <= mem
    # the CLI prints the same tokens for the same flags
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["plan", "--model", model, "--memory", f"{space}GiB", "--device", "cpu",
                         "--kv-dtype", kv_dtype]) == 0
    out = buf.getvalue()
    assert f"| {row.kv_dtype} | torch | {runner.config.page_size} |" in out
    assert f"| {runner.pool.num_pages:,} | {row.sizing.tokens:,} |" in out


CPU_HOST = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="plans for CUDA from a host without it (tests/gpu: with it)")


@CPU_HOST
@pytest.mark.parametrize("backend", ["auto", "triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_cuda_plan_prices_the_page_size_each_backend_chooses(backend, kv_dtype):
    """Planned from a CPU host for CUDA: auto is triton at head_dim 128 (fp8: pages of 32,
    token-minor V; bf16: pages of 16), as on a GPU host with FlashInfer installed."""
    from kvfit.attention.registry import backend_class

    mem = parse_memory("2.90GiB")
    (row,) = plan_capacity(EngineConfig(model=QWEN3, attention_backend=backend), mem,
                           [kv_dtype], device="cuda")
    s = row.settings
    fp8 = kv_dtype.startswith("fp8")
    want = backend if backend != "auto" else "triton"
    assert s.backend_name == want and s.device.type == "cuda" and s.assumed_installed
    ps = backend_class(want).default_page_size(kv_dtype, 128)
    assert s.page_size == ps == (32 if want == "triton" and fp8 else 16)
    assert s.v_layout == ("HDN" if want == "triton" and fp8 else "HND")
    bpt = spec_kv_bytes_per_token(s.layers, s.kv_format)
    assert bpt == 28 * 8 * 128 * 2 * s.kv_format.itemsize
    assert row.sizing.tokens == mem // (ps * bpt) * ps
    if want == "triton" and fp8:
        assert row.sizing.tokens == 54_272  # not the 54,288 that pages of 16 would give
    explicit = plan_capacity(EngineConfig(model=QWEN3, attention_backend=backend, page_size=64),
                             mem, [kv_dtype], device="cuda")[0]
    assert explicit.settings.page_size == 64 and explicit.sizing.tokens == mem // (64 * bpt) * 64


@CPU_HOST
def test_plan_says_when_an_explicit_max_model_len_does_not_fit():
    mem = parse_memory("1GiB")
    rows = plan_capacity(EngineConfig(model=QWEN3, max_model_len=12_000), mem,
                         ["bfloat16", "fp8_e4m3"])
    from kvfit.plan import format_plan

    text = format_plan(mem, rows)
    assert rows[0].sizing.tokens < 12_000 <= rows[1].sizing.tokens
    assert "--max-model-len 12,000 does not fit the bfloat16 KV cache" in text


@CPU_HOST
def test_plan_for_cuda_refuses_what_the_engine_would(tmp_path):
    hybrid = _config_json(tmp_path, "hybrid")
    s = resolve_settings(EngineConfig(model=hybrid, kv_dtype="fp8_e4m3"), plan_for="cuda")
    # triton holds the hybrid pool but not these 16-d heads, fi neither (Gemma 3's 256-d heads
    # plan triton: tests/test_swa_gpu_plan.py)
    assert s.backend_name == "torch"
    with pytest.raises(UnsupportedCombinationError, match="these backends support it: torch"):
        resolve_settings(EngineConfig(model=hybrid, attention_backend="fi"), plan_for="cuda")
    with pytest.raises(ValueError, match="plan_for"):
        resolve_settings(EngineConfig(model=hybrid), plan_for="tpu")


def test_settings_are_what_the_runner_builds(tmp_path):
    from kvfit.engine.runner import ModelRunner

    model = _config_json(tmp_path, "mha")
    s = resolve_settings(EngineConfig(model=model, load_format="dummy", device="cpu",
                                      num_pages=8, kv_dtype="fp8_e5m2"))
    assert s.config.page_size == s.page_size == 16 and s.backend_name == "torch"
    assert s.max_model_len == 512 and s.kv_format.name == "fp8_e5m2"
    assert "attention backend torch (auto)" in s.describe()
    runner = ModelRunner(s)
    assert runner.settings is s and runner.pool.num_pages == 8
    assert type(runner.pool) is s.pool_cls and runner.pool.v_layout == s.v_layout
    assert runner.max_model_len == 8 * 16  # lowered to the capacity after sizing
    with pytest.raises(ValueError, match="load-format dummy"):
        resolve_settings(EngineConfig(model=model, device="cpu"))


def test_one_request_check():
    assert check_request([1, 2, 3], None, 10) == 7
    assert check_request([1, 2, 3], 7, 10) == 7
    with pytest.raises(RequestRejected) as e:
        check_request([1, 2, 3], 8, 10)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert str(e.value) == ("This model's maximum context length is 10 tokens. However, you "
                            "requested 11 tokens (3 in the prompt, 8 in the completion). Please "
                            "reduce the length of the prompt or completion.")
    with pytest.raises(RequestRejected, match="12 tokens \\(11 in the messages") as e:
        check_request(list(range(11)), 1, 10, prompt_param="messages")
    assert e.value.param == "messages"  # the prompt alone fills the context
    with pytest.raises(RequestRejected, match="11 tokens \\(10 in the prompt, 1 in"):
        check_request(list(range(10)), None, 10)
    with pytest.raises(RequestRejected, match="the prompt is empty") as e:
        check_request([], 5, 10)
    assert e.value.param == "prompt"
    with pytest.raises(RequestRejected, match=r"must be in \[0, 50\), got 50"):
        check_request([3, 50], 1, 10, vocab_size=50)
    with pytest.raises(RequestRejected, match="max_tokens must be >= 1") as e:
        check_request([1], 0, 10)
    assert e.value.param == "max_tokens"
