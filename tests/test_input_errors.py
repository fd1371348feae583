"""A newcomer's first hour (issue 19): every broken input gets one `kvfit: error:` line (exit 1,
no traceback) before anything heavy loads; defaults the library fills are warned about; the
default --max-tokens is capped to the context; the CLI says why it stopped; `kvfit --version`."""

from __future__ import annotations

import json
import shutil

import pytest

from kvfit.cli import main



def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def _qwen3(tmp_path, drop=(), **changes) -> str:
    from kvfit.bench.configs import config_path

    with open(config_path("qwen3-1.7b")) as f:  # the shipped Qwen3-1.7B config
        cfg = json.load(f)
    for k in drop:
        del cfg[k]
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _smollm2_path() -> str:
    from kvfit.models.registry import resolve_model

    try:
        return resolve_model("smollm2-135m").path
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bundled model not installed: {e}")


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the CLI gets as far as the tokenizer or the engine."""
    import kvfit.engine.llm_engine as eng

    def boom(*a, **k):
        raise AssertionError("loaded the tokenizer before the cheap checks")

    monkeypatch.setattr(eng, "load_tokenizer", boom)


def test_truncated_gguf(tmp_path, capsys, no_model_loading):
    src = _smollm2_path()
    data = open(src, "rb").read()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    rc, _, err = _run(capsys, ["generate", "hi", "--model", str(half), "--device", "cpu"])
    assert rc == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvfit: error:") and str(half) in line and "truncated" in line
    assert f"{len(data) // 2:,}" in line and "again" in line  # the file size and the fix


def test_text_file_renamed_gguf(tmp_path, capsys, no_model_loading):
    fake = tmp_path / "notes.gguf"
    fake.write_text("these are my notes, not a model\n" * 10)
    rc, _, err = _run(capsys, ["plan", "--model", str(fake), "--memory", "1GiB"])
    assert rc == 1
    assert f"kvfit: error: {fake} is not a GGUF file" in err and "magic" in err


def test_config_without_model_type(tmp_path, capsys):
    path = _qwen3(tmp_path, drop=("model_type",))
    rc, _, err = _run(capsys, ["plan", "--model", path, "--memory", "2.9GiB"])
    assert rc == 1
    assert f"kvfit: error: {path} has no model_type" in err
    assert "Qwen3ForCausalLM" in err and '"model_type"' in err  # the fix


def test_qwen3_without_kv_heads_warns_and_refuses(tmp_path, capsys):
    path = _qwen3(tmp_path, drop=("num_key_value_heads",))
    rc, _, err = _run(capsys, ["plan", "--model", path, "--memory", "2.9GiB"])
    assert rc == 1
    warn = [l for l in err.splitlines() if l.startswith("kvfit: warning:")]
    assert any("has no num_key_value_heads" in l and "num_key_value_heads=32" in l for l in warn)
    assert "num_key_value_heads=32 is more than num_attention_heads=16" in err
    assert err.strip().splitlines()[-1].startswith("kvfit: error:")


def test_kv_heads_must_divide_query_heads(tmp_path, capsys):
    path = _qwen3(tmp_path, num_key_value_heads=6)
    rc, _, err = _run(capsys, ["plan", "--model", path, "--memory", "2.9GiB"])
    assert rc == 1
    assert "num_attention_heads=16 is not a multiple of num_key_value_heads=6" in err


def test_complete_qwen3_config_plans_the_seed_figure(tmp_path, capsys):
    path = _qwen3(tmp_path)
    rc, out, err = _run(capsys, ["plan", "--model", path, "--memory", "2.9GiB",
                                 "--kv-dtype", "bfloat16"])
    assert rc == 0 and "kvfit: warning" not in err
    row = next(l for l in out.splitlines() if l.startswith("| bfloat16 |"))
    assert "| 114,688 | 1,696 | 27,136 |" in row  # the seed's figure, with 8 KV heads


def test_config_without_hidden_size_refused_before_allocating(tmp_path, capsys, monkeypatch):
    import kvfit.engine.memory as memory

    # the default hidden_size 4096 makes ~3.4 B parameters (13.6 GiB of float32 while loading)
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: 4 << 30)
    path = _qwen3(tmp_path, drop=("hidden_size",))
    rc, _, err = _run(capsys, ["generate", "hi", "--model", path, "--load-format", "dummy",
                               "--device", "cpu", "--num-tokens", "64"])
    assert rc == 1
    assert "kvfit: warning:" in err and "has no hidden_size" in err and "hidden_size=4096" in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvfit: error: the weights of") and "do not fit" in line
    assert "4.00 GiB is available" in line and "B parameters need" in line


def test_weight_estimate_matches_the_built_model():
    import torch

    from server_common import TINY_LLAMA
    from transformers import CONFIG_MAPPING

    from kvfit.engine.preflight import estimate_weights
    from kvfit.models import registry as models

    cfg = CONFIG_MAPPING["llama"](**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    cls = models.model_class_for(cfg)
    est = estimate_weights(cls, cfg, 128, torch.bfloat16)
    real = cls(cfg, 128)
    n = sum(p.numel() for p in real.parameters())
    assert est.num_params == n and est.resident == 2 * n and est.peak == 4 * n


def test_empty_prompt_refused_before_loading(capsys, monkeypatch):
    import kvfit.llm

    def boom(*a, **k):
        raise AssertionError("built the engine for an empty prompt")

    monkeypatch.setattr(kvfit.llm.LLM, "__init__", boom)
    for argv in (["generate", ""], ["generate", "--prompt", "   "]):
        rc, _, err = _run(capsys, argv)
        assert rc == 1 and "kvfit: error: the prompt is empty" in err


def test_bad_backend_refused_before_tokenizer(capsys, no_model_loading):
    rc, _, err = _run(capsys, ["generate", "hi", "--attention-backend", "fi", "--device", "cpu"])
    assert rc == 1
    assert "kvfit: error: unsupported combination" in err and "torch" in err


def test_version(capsys):
    from kvfit import __version__

    for flag in ("--version", "-V"):
        rc, out, _ = _run(capsys, [flag])
        assert rc == 0 and out.strip() == f"kvfit {__version__}"


def test_default_max_tokens_capped_to_context(capsys):
    _smollm2_path()
    rc, out, err = _run(capsys, ["generate", "hi", "The capital of France is",
                                 "--max-model-len", "12", "--num-tokens", "256",
                                 "--device", "cpu"])
    assert rc == 0
    warn = [l for l in err.splitlines() if "--max-tokens not given" in l]
    assert len(warn) == 2 and all(l.startswith("kvfit: warning:") for l in warn)
    assert "--max-model-len 12" in warn[0] and "instead of the default 128" in warn[0]
    assert out.count("--- prompt ") == 2
    assert "Processed prompts" in err  # the progress bar of a multi-prompt run
    stops = [l for l in err.splitlines() if l.startswith("kvfit: stopped on ")]
    assert len(stops) == 2 and all("length" in l or "EOS" in l for l in stops)
    assert any("--max-model-len of 12" in l for l in stops)
    assert "tok/s" in err.strip().splitlines()[-1]


def test_explicit_max_tokens_not_capped():
    import dataclasses

    from kvfit.cli_generate import cap_max_tokens
    from kvfit.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=128)
    assert cap_max_tokens(sp, 1, 64, given=False)[0].max_tokens == 63
    assert cap_max_tokens(sp, 1, 64, given=True)[0].max_tokens == 128  # refused by the engine
    assert cap_max_tokens(sp, 1, 4096, given=False)[0].max_tokens == 128
    assert cap_max_tokens(sp, 70, 64, given=False) == (dataclasses.replace(sp, max_tokens=1),
                                                       False)  # too long: refused with 70 + 1


def test_stop_on_max_tokens_is_reported(capsys):
    _smollm2_path()
    rc, out, err = _run(capsys, ["generate", "Once upon a time", "--max-tokens", "3",
                                 "--num-tokens", "256", "--device", "cpu"])
    assert rc == 0 and out.strip()
    assert "kvfit: stopped on length (the --max-tokens limit of 3 tokens)" in err
    assert "3 tokens generated in" in err and "tok/s" in err


def test_config_transformers_rejects_is_one_line(tmp_path, capsys):
    path = _qwen3(tmp_path, hidden_size="big")
    rc, _, err = _run(capsys, ["plan", "--model", path, "--memory", "1GiB"])
    assert rc == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"kvfit: error: {path}: transformers cannot build") and "hidden_size" in line


def test_busy_cpu_warning(monkeypatch, caplog):
    import logging
    import os

    import torch

    from kvfit.engine import preflight

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    caplog.set_level(logging.WARNING, logger="kvfit")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    preflight.warn_busy_cpu()
    assert not caplog.records  # an idle machine: no warning
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 6.0, 5.0))
    preflight.warn_busy_cpu()
    assert "load average 7.5 on 2 cores" in caplog.text and "OMP_NUM_THREADS=1" in caplog.text
    caplog.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user chose: stay quiet
    preflight.warn_busy_cpu()
    assert not caplog.records


def test_cuda_device_without_gpu(capsys, no_model_loading):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, _, err = _run(capsys, ["generate", "hi", "--device", "cuda"])
    assert rc == 1 and "kvfit: error: device='cuda' but no CUDA device" in err and "--device cpu" in err
