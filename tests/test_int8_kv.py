"""int8 KV (issue 14): the quantizer (bytes against a float64 reference, saturation), the Hadamard
rotation and K centering (exact in float64 and through the torch backend, soft-capped layers
included), the V rotation folded into the weights (same logits as the unfolded model), the
price of the scales (pool bytes == plan bytes), the guard's refusals and the prefix-cache
identity. All small and CPU-only."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.torch_attend import attend
from kvfit.attention.torch_ref import TorchRefBackend
from kvfit.config import EngineConfig
from kvfit.engine.context import Context
from kvfit.engine.guard import check_combination
from kvfit.errors import UnsupportedCombinationError
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.kv_transform import KVTransform, hadamard
from kvfit.kvcache.pool import MHAKVCache
from kvfit.kvcache.quant import MIN_SCALE, dequantize_int8_rows, quantize_int8_rows
from kvfit.kvcache.registry import resolve_pool_class
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token
from kvfit.models.kv_rotation_fold import fold_v_rotation

INT8 = kv_format("int8")
CPU = torch.device("cpu")


def _ref_quantize(x: torch.Tensor):
    """The contract's formula in float64 (IEEE division of float32 values, half-even)."""
    amax = x.float().abs().amax(-1)
    scale = torch.clamp(amax / 127, min=2.0 ** -14).to(torch.float16)
    q = torch.round(x.double() / scale.double().unsqueeze(-1)).clamp(-127, 127)
    return q.to(torch.int8), scale


def test_int8_round_trip_matches_reference_bytes():
    g = torch.Generator().manual_seed(1)
    # rows of very different magnitudes, plus Qwen-like offsets
    x = torch.randn(64, 3, 128, generator=g) * torch.logspace(-3, 2.5, 64)[:, None, None]
    x[5, 1, 7] = 217.0
    q, s = quantize_int8_rows(x)
    qr, sr = _ref_quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == x.shape[:-1]
    assert torch.equal(s, sr) and torch.equal(q, qr)
    back = dequantize_int8_rows(q, s, torch.float32)
    err = (back - x).abs()
    assert bool((err <= s.float().unsqueeze(-1) / 2 * (1 + 1e-6)).all())  # half a step at most
    normal = x.abs().amax(-1) / 127 >= MIN_SCALE  # rows whose scale is not the floor
    assert 0 < int(normal.sum()) < normal.numel()
    assert (q.abs() == 127).any(dim=-1)[normal].all()  # those use their full range


def test_int8_saturation_never_stores_nan_inf_or_zero_scales():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big, 1.0, 0.0], [1e-30, -1e-30, 0.0, 0.0], [0.0] * 4,
                      [1e5, -3.0, 2.0, 1.0], [1e-8, 3e-8, -2e-8, 0.0]])
    q, s = quantize_int8_rows(x)
    assert bool(torch.isfinite(s.float()).all()) and bool((s.float() >= MIN_SCALE).all())
    back = dequantize_int8_rows(q, s, torch.float32)
    assert bool(torch.isfinite(back).all())
    assert q[0, 0] == 127 and q[0, 1] == -127  # saturated, sign kept
    assert q[3, 0] == 127 and torch.equal(q[2], torch.zeros(4, dtype=torch.int8))
    # random finite inputs over the whole float32 range
    g = torch.Generator().manual_seed(2)
    r = torch.randn(200, 64, generator=g) * torch.exp(torch.randn(200, 1, generator=g) * 30)
    q, s = quantize_int8_rows(r)
    assert bool(torch.isfinite(s.float()).all()) and bool((s.float() > 0).all())


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(d):
    h = hadamard(d).double()
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T) and h.dtype == torch.float64
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


def test_rotation_and_centering_leave_qk_shift_and_pv_exact_in_float64():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(7, 2, 64, generator=g, dtype=torch.float64) + 3.0
    v = torch.randn(7, 2, 64, generator=g, dtype=torch.float64)
    mu = torch.randn(2, 64, generator=g) * 4
    h = hadamard(64).double()
    kr = (k - mu.double()) @ h
    qr = q @ h
    for j in range(4):  # q head j reads KV head j // 2
        s = q[:, j] @ k[:, j // 2].T
        sr = qr[:, j] @ kr[:, j // 2].T
        shift = q[:, j] @ mu[j // 2].double()
        assert torch.allclose(sr, s - shift[:, None], atol=1e-10)
        p = torch.softmax(s, -1)
        assert torch.allclose(torch.softmax(sr, -1), p, atol=1e-12)  # row shift: same P
        assert torch.allclose((p @ (v[:, j // 2] @ h)) @ h.T, p @ v[:, j // 2], atol=1e-12)


def _pool_backend(layers, fmt, softcap=None, transform=None, pages=8, ps=4):
    pool = MHAKVCache(layers, pages, ps, fmt, CPU)
    pool.kv_transform = transform
    return pool, TorchRefBackend(pool, torch.float32, 0.125, softcap)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_torch_backend_centering_and_rotation_exact_with_and_without_softcap(softcap):
    """float32 cache: attention over (k - mu) @ H with q @ H (and V rotated, output un-rotated)
    equals plain attention; a soft-capped layer needs q.mu added back (checked to matter)."""
    g = torch.Generator().manual_seed(4)
    layers = [KVLayerSpec("full", 2, 64)]
    t = 11
    q = torch.randn(t, 4, 64, generator=g) * 2
    k = torch.randn(t, 2, 64, generator=g) + torch.randn(2, 64, generator=g) * 5
    v = torch.randn(t, 2, 64, generator=g)
    meta = build_metadata([t], [t], [[0, 1, 2]], 4, CPU)
    pool, be = _pool_backend(layers, kv_format("float32"), softcap)
    be.prepare(meta)
    ref = be.forward(q, k, v, 0)
    mu = torch.randn(2, 64, generator=g) * 5
    h = hadamard(64)
    tf = KVTransform([mu], rotate=True)
    pool2, be2 = _pool_backend(layers, kv_format("float32"), softcap, tf)
    be2.prepare(meta)
    out = be2.forward(q, k, v @ h, 0) @ h.T  # v arrives rotated (the weight fold), o un-rotated
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5)
    stored = pool2.k_caches[0][:3].transpose(1, 2).reshape(-1, 2, 64)[:t]
    assert torch.allclose(stored, (k - mu) @ h, atol=1e-5)  # the pool holds (k - mu) @ H
    if softcap is not None:  # without the add-back the capped logits differ
        qr, kr = tf.transform_qk(0, q, k)
        wrong = attend(qr, kr, v @ h, 0.125, softcap=softcap) @ h.T
        assert (wrong - ref).abs().max() > 1e-2


def _tiny_model(kind: str, seed: int = 0):
    """(model, cfg): a tiny llama / qwen2 (q/k/v bias) / gemma2 (soft-capped) with random
    weights, float32."""
    from modelhelpers import TINY
    from transformers import CONFIG_MAPPING

    from kvfit.models import registry as models

    if kind == "gemma2":
        from test_gemma3 import _tiny_cfg

        cfg = _tiny_cfg("gemma2")
    else:
        kw = dict(TINY[kind])
        kw.update(head_dim=16) if kind == "llama" else None
        cfg = CONFIG_MAPPING[kw.pop("model_type")](**kw)
    cls = models.model_class_for(cfg)
    torch.manual_seed(seed)
    model = cls(cfg, 64).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
    return model, cfg, cls


def _logits(model, cfg, cls, ids, fmt, transform=None):
    layers = cls.kv_layer_specs(cfg)
    pool = resolve_pool_class(layers)(layers, 8, 8, fmt, CPU)
    pool.kv_transform = transform
    be = TorchRefBackend(pool, torch.float32, cls.sm_scale(cfg), cls.logit_softcap_of(cfg))
    n = len(ids)
    be.prepare(build_metadata([n], [n], [list(range(-(-n // 8)))], 8, CPU))
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(n), Context(be, pool, torch.float32))
        return model.compute_logits(h), pool


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_folded_rotated_centered_model_gives_the_same_logits(kind):
    model, cfg, cls = _tiny_model(kind)
    ids = torch.randint(0, cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(5))
    ids = ids.tolist()
    ref, ref_pool = _logits(model, cfg, cls, ids, kv_format("float32"))
    folded = copy.deepcopy(model)
    assert fold_v_rotation(folded) == cfg.num_hidden_layers
    layers = cls.kv_layer_specs(cfg)
    g = torch.Generator().manual_seed(6)
    tf = KVTransform([torch.randn(l.num_kv_heads, l.head_dim, generator=g) * 3 for l in layers],
                     rotate=True)
    out, pool = _logits(folded, cfg, cls, ids, kv_format("float32"), tf)
    assert torch.allclose(out, ref, atol=2e-4, rtol=1e-4), (out - ref).abs().max()
    # the pool holds V rotated per head (the fold) and K centered and rotated
    h = hadamard(layers[0].head_dim)
    for i in range(len(layers)):
        assert torch.allclose(pool.v_caches[i][0], ref_pool.v_caches[i][0] @ h, atol=1e-4)
        assert torch.allclose(pool.k_caches[i][0], (ref_pool.k_caches[i][0]
                                                    - tf.k_mean[i][:, None]) @ h, atol=1e-4)
    # int8 through the same path stays close to the float32 cache
    q8, _ = _logits(folded, cfg, cls, ids, INT8, tf)
    lp, lr = torch.log_softmax(q8, -1), torch.log_softmax(ref, -1)
    assert float((lr.exp() * (lr - lp)).sum(-1).mean()) < 1e-3


def test_int8_pool_prices_its_scales_to_the_byte():
    layers = [KVLayerSpec("full", 3, 64)] * 4
    assert spec_kv_bytes_per_token(layers, INT8) == 4 * 2 * 3 * (64 + 2)
    pool = MHAKVCache(layers, 5, 16, INT8, CPU)
    assert pool.allocated_bytes() == pool.priced_bytes() == 5 * 16 * 4 * 2 * 3 * 66
    assert pool.k_scale_caches[0].shape == (5, 3, 16) and pool.k_scale_caches[0].dtype == torch.float16
    bf16 = MHAKVCache(layers, 5, 16, kv_format("bfloat16"), CPU)
    assert bf16.k_scale_caches == [] and bf16.allocated_bytes() == bf16.priced_bytes()


@pytest.mark.parametrize("v_layout", ["HND", "HDN"])
def test_int8_pool_store_gather_round_trip(v_layout):
    g = torch.Generator().manual_seed(7)
    layers = [KVLayerSpec("full", 2, 32)]
    pool = MHAKVCache(layers, 4, 8, INT8, CPU, v_layout=v_layout)
    k = torch.randn(13, 2, 32, generator=g) * 3
    v = torch.randn(13, 2, 32, generator=g)
    slots = torch.tensor([8 * 2 + i for i in range(8)] + [8 * 0 + i for i in range(5)])
    pool.store_kv(0, k, v, slots)
    kk, vv = pool.gather_kv(0, torch.tensor([2, 0]), 13, torch.float32)
    qk, sk = quantize_int8_rows(k)
    assert torch.equal(kk, dequantize_int8_rows(qk, sk, torch.float32))
    qv, sv = quantize_int8_rows(v)
    assert torch.equal(vv, dequantize_int8_rows(qv, sv, torch.float32))


def test_plan_and_engine_allocate_the_same_int8_bytes(tmp_path):
    from test_settings_plan import QWEN3, _config_json

    from kvfit.engine.runner import ModelRunner
    from kvfit.plan import plan_capacity

    mem = 2.9 * 2**30
    rows = plan_capacity(EngineConfig(model=QWEN3, attention_backend="torch"), int(mem),
                         ["bfloat16", "int8"], device="cuda")
    assert rows[1].sizing.bytes_per_token == 28 * 2 * 8 * (128 + 2)
    assert rows[1].ratio_vs_first >= 1.94  # issue 14's capacity target
    for kind in ("mha", "hybrid"):
        model = _config_json(tmp_path, kind)
        space = 0.0123
        (row,) = plan_capacity(EngineConfig(model=model, attention_backend="torch"),
                               int(space * 2**30), ["int8"], device="cpu")
        runner = ModelRunner(EngineConfig(model=model, load_format="dummy", device="cpu",
                                          kv_dtype="int8", cpu_kv_space_gib=space))
        assert row.sizing == runner.sizing and runner.pool.num_pages == row.sizing.num_pages
        assert runner.pool.priced_bytes() == runner.pool.allocated_bytes() <= space * 2**30
        assert runner.pool.kv_transform is not None and runner.pool.kv_transform.rotate


def test_guard_refuses_int8_where_it_cannot_run():
    from test_mla import _tiny_cfg

    from kvfit.kvcache.mla import MLAKVCache

    layers = [KVLayerSpec("full", 2, 128)]
    with pytest.raises(UnsupportedCombinationError, match="FlashInfer reads only 16-bit and fp8.*"
                       "--attention-backend triton"):
        check_combination("fi", MHAKVCache, INT8, 16, "cuda", layers, assume_installed=True)
    # the triton backend reads int8 (kernels/, issue 14) and applies both transforms
    check_combination("triton", MHAKVCache, INT8, 16, "cuda", layers, assume_installed=True)
    check_combination("torch", MHAKVCache, INT8, 16, "cpu", layers)  # the reference reads it
    mla = [KVLayerSpec("mla", 1, 576)]
    with pytest.raises(UnsupportedCombinationError, match="MLAKVCache pool does not store int8.*"
                       "latent slab"):
        check_combination("torch", MLAKVCache, INT8, 16, "cpu", mla)
    assert _tiny_cfg  # the MLA model resolves the same pool (tests/test_mla.py)


def test_int8_needs_a_backend_that_rotates():
    from kvfit.engine.guard import required_transforms

    from kvfit.attention.triton_backend import TritonBackend

    assert required_transforms(INT8) == {"rotate"} <= TorchRefBackend.kv_transforms
    assert TritonBackend.kv_transforms == {"k_mean", "rotate"}
    assert not required_transforms(kv_format("fp8_e4m3"))  # centering is optional for fp8


def test_prefix_cache_identity_includes_the_transform():
    from kvfit.kvcache.prefix_cache import kv_identity

    layers = [KVLayerSpec("full", 2, 64)]
    pool = MHAKVCache(layers, 2, 16, INT8, CPU)
    pool.kv_transform = KVTransform([torch.ones(2, 64)], rotate=True)
    a = kv_identity(("m",), pool)
    pool.kv_transform = KVTransform([torch.ones(2, 64) * 1.5], rotate=True)
    b = kv_identity(("m",), pool)
    pool.kv_transform = None
    assert a != b != kv_identity(("m",), pool)


def test_calibration_file_round_trip_and_refusals(tmp_path):
    from kvfit.engine.kv_calibration import load_calibration, save_calibration

    layers = [KVLayerSpec("full", 2, 8)] * 3
    means = [torch.randn(2, 8), None, torch.randn(2, 8)]
    path = str(tmp_path / "k.json")
    save_calibration(path, means, {"model": "x"})
    back = load_calibration(path, layers)
    assert back[1] is None and torch.equal(back[0], means[0]) and torch.equal(back[2], means[2])
    with pytest.raises(ValueError, match="one entry per layer"):
        load_calibration(path, layers[:2])
    with pytest.raises(ValueError, match="layer 0 mean has shape"):
        load_calibration(path, [KVLayerSpec("full", 1, 8)] * 3)
    with pytest.raises(FileNotFoundError, match="write_kv_calibration"):
        load_calibration(str(tmp_path / "none.json"), layers)
    json.dump({"k_mean": [[[float("nan")] * 8] * 2, None, None]}, open(path, "w"))
    with pytest.raises(ValueError, match="not finite"):
        load_calibration(path, layers)


def test_cli_flags_come_from_the_config():
    import argparse

    from kvfit.config import add_engine_args, config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    c = config_from_args(p.parse_args(["--kv-dtype", "int8", "--kv-k-centering", "off",
                                       "--kv-calibration", "k.json"]))
    assert c.kv_dtype == "int8" and c.kv_k_centering == "off" and c.kv_calibration == "k.json"
    assert config_from_args(p.parse_args([])).kv_k_centering == "auto"
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        p.parse_args(["--kv-k-centering", "maybe"])
