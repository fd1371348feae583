"""Fused elementwise kernels (RMSNorm, add+RMSNorm, RoPE, gated activation) vs the torch code
they replace (``models/layers.py``'s CPU path, run here on the same CUDA inputs) and vs a float64
reference, on fresh random inputs, strided views and poisoned outputs; then whole tiny models on
CUDA (the dispatching layers) vs the same models on the CPU."""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# unit roundoff of each dtype (half an ulp at 1.0)
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def seed_of(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the dtype's ulp at max(|a|, |b|) (0 where equal)."""
    a64, b64 = a.double(), b.double()
    mag = torch.maximum(a64.abs(), b64.abs()).clamp_min(torch.finfo(a.dtype).tiny)
    ulp = 2.0 ** torch.floor(torch.log2(mag)) * (2 * U[a.dtype])
    return (a64 - b64).abs() / ulp


def assert_close_to_torch(y, ref, max_frac, max_ulp=1.0):
    """y within ``max_ulp`` ulps of the same-dtype torch path everywhere, and equal to it on all
    but ``max_frac`` of the elements (differences come from float32 reduction order, rsqrt)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    d = ulp_diff(y, ref)
    assert d.max().item() <= max_ulp * (1 + 1e-9), d.max().item()  # ulp_diff rounds in float64
    frac = (y != ref).double().mean().item()
    assert frac <= max_frac, frac


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


# ---------------------------------------------------------------------------------- RMSNorm


def norm_ref(x, w, eps, offset):
    """models.layers.RMSNorm's torch path."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + w.float())).to(dtype)
    return w * xf.to(dtype)


def norm_ref64(x, w, eps, offset):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


NORM_SHAPES = [(1, 576), (7, 576), (3, 2048), (33, 2048), (2, 4096), (5, 1000), (1, 8192),
               (4, 16, 128), (3, 9, 64), (2, 8, 256), (11, 5, 96), (1, 1, 128)]


def _norm_input(shape, dtype, gen):
    """Random x with a strided layout like the model's (a view into a wider fused buffer)."""
    n = shape[-1]
    scale = 0.5 + 4 * torch.rand((), generator=gen).item()
    if len(shape) == 3:
        big = torch.randn(shape[0], (shape[1] + 3) * n, generator=gen) * scale
        return big.to(dtype).to(DEV)[:, : shape[1] * n].view(shape)  # [T, heads, D], strided
    big = torch.randn(shape[0], n + 37, generator=gen) * scale
    return big.to(dtype).to(DEV)[:, :n]  # [T, N], row stride N + 37


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype, shape, offset):
    from kvfit.kernels.fused_norm import rms_norm

    gen = seed_of(dtype, shape, offset)
    n = shape[-1]
    x = _norm_input(shape, dtype, gen)
    w = ((0.0 if offset else 1.0) + 0.3 * torch.randn(n, generator=gen)).to(dtype).to(DEV)
    eps = 1e-6
    x_before = x.clone()
    out = poisoned(shape, dtype)
    y = rms_norm(x, w, eps, offset, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(x, x_before)  # input untouched
    fp32 = dtype == torch.float32  # no output rounding to hide rsqrt/summation-order bits
    assert_close_to_torch(y, norm_ref(x, w, eps, offset), max_frac=1.0 if fp32 else 0.02,
                          max_ulp=16.0 if fp32 else 1.0)
    r64 = norm_ref64(x, w, eps, offset)
    tol = 3 * U[dtype] * r64.abs() + 1e-6 * r64.abs().max()
    assert ((y.double() - r64).abs() <= tol).all(), ((y.double() - r64).abs() / tol).max().item()
    assert torch.equal(rms_norm(x, w, eps, offset), y)  # allocating variant, deterministic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (9, 2048), (4, 4096), (3, 1000), (5, 8, 128)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_add_rms_norm(dtype, shape, offset):
    from kvfit.kernels.fused_norm import fused_add_rms_norm

    gen = seed_of(dtype, shape, offset, "add")
    n = shape[-1]
    x = _norm_input(shape, dtype, gen)
    res = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEV)
    w = ((0.0 if offset else 1.0) + 0.3 * torch.randn(n, generator=gen)).to(dtype).to(DEV)
    x_before, res_before = x.clone(), res.clone()
    out, rout = poisoned(shape, dtype), poisoned(shape, dtype)
    y, s = fused_add_rms_norm(x, res, w, 1e-5, offset, out=out, residual_out=rout)
    assert y.data_ptr() == out.data_ptr() and s.data_ptr() == rout.data_ptr()
    assert torch.equal(x, x_before) and torch.equal(res, res_before)
    s_ref = x + res  # the torch path: add in the dtype, then norm
    assert torch.equal(s, s_ref)
    fp32 = dtype == torch.float32
    assert_close_to_torch(y, norm_ref(s_ref, w, 1e-5, offset), max_frac=1.0 if fp32 else 0.02,
                          max_ulp=16.0 if fp32 else 1.0)
    r64 = norm_ref64(s_ref, w, 1e-5, offset)
    tol = 3 * U[dtype] * r64.abs() + 1e-6 * r64.abs().max()
    assert ((y.double() - r64).abs() <= tol).all()


# ---------------------------------------------------------------------------------- RoPE


def rope_tables(max_pos, rot, theta, scaling=1.0):
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(DEV), (emb.sin() * scaling).to(DEV)


# (T, Hq, Hk, head_dim, rot_dim)
ROPE_CASES = [(1, 16, 8, 128, 128), (7, 16, 8, 128, 128), (5, 9, 3, 64, 64), (3, 8, 4, 256, 256),
              (300, 32, 8, 128, 128), (4, 4, 1, 64, 32), (6, 7, 7, 80, 40), (2, 40, 8, 128, 64),
              (3, 64, 8, 128, 128), (2, 4, 4, 256, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope(dtype, case):
    from kvfit.kernels.fused_rope import apply_rope
    from kvfit.models.layers import _apply

    t, hq, hk, d, rot = case
    gen = seed_of(dtype, case)
    cos, sin = rope_tables(8192, rot, 1e6 if rot == d else 1e4, 1.0 if rot == d else 1.2)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype).to(DEV)
    q = qkv[:, : hq * d].view(t, hq, d)  # [T, Hq, D] strided views, as the model passes them
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    pos = torch.randint(0, 8192, (t,), generator=gen).to(DEV)
    if t > 1:
        pos[0] = 8191
    qkv_before = qkv.clone()
    qo, ko = poisoned((t, hq, d), dtype), poisoned((t, hk, d), dtype)
    rq, rk = apply_rope(q, k, cos, sin, pos, q_out=qo, k_out=ko)
    assert rq.data_ptr() == qo.data_ptr() and rk.data_ptr() == ko.data_ptr()
    assert torch.equal(qkv, qkv_before)
    c = cos[pos].to(dtype)[:, None, :]
    s = sin[pos].to(dtype)[:, None, :]
    # against the torch path: out = x1*c - x2*s cancels, so a result's own ulp is no yardstick
    # (measured on the H200: up to 96 result-ulps in fp16, 2e5 in fp32 where the compiler fuses
    # an FMA); bound the difference by rounding errors of the terms, 4u * (|x1| + |x2|)
    for x, y in ((q, rq), (k, rk)):
        ref_t = _apply(x, c, s)
        xr = x[..., :rot].double().abs()
        mag = xr[..., : rot // 2] + xr[..., rot // 2:]
        bound = torch.cat((mag, mag, torch.zeros_like(x[..., rot:], dtype=torch.float64)), -1)
        assert torch.isfinite(y).all()
        assert ((y.double() - ref_t.double()).abs() <= 4 * U[dtype] * bound + 1e-30).all()
    # float64 bound: cos/sin cast to the dtype (u each), two products and a sum rounded (3u)
    c64, s64 = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    for x, y in ((q, rq), (k, rk)):
        ref = _apply(x.double(), c64, s64)
        xr = x[..., :rot].double().abs()
        mag = xr[..., : rot // 2] + xr[..., rot // 2:]
        bound = torch.cat((mag, mag, torch.zeros_like(x[..., rot:], dtype=torch.float64)), -1)
        tol = 6 * U[dtype] * bound + 1e-30
        assert ((y.double() - ref).abs() <= tol).all()
        assert torch.equal(y[..., rot:], x[..., rot:])  # partial rotary: pass-through


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(1, 16, 8, 128, 128), (9, 16, 8, 128, 128), (5, 9, 3, 64, 64),
                                  (3, 8, 4, 256, 256), (4, 4, 1, 64, 32), (6, 7, 7, 80, 40)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_qk_norm_rope(dtype, case, offset):
    """q/k RMSNorm + RoPE in one launch == rms_norm then RoPE (torch path and the kernels)."""
    from kvfit.kernels.fused_norm import rms_norm
    from kvfit.kernels.fused_rope import apply_rope
    from kvfit.models.layers import _apply

    t, hq, hk, d, rot = case
    gen = seed_of(dtype, case, offset, "qknorm")
    cos, sin = rope_tables(4096, rot, 1e6)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype).to(DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    base = 0.0 if offset else 1.0
    qw = (base + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(DEV)
    kw = (base + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(DEV)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    qkv_before = qkv.clone()
    qo, ko = poisoned((t, hq, d), dtype), poisoned((t, hk, d), dtype)
    rq, rk = apply_rope(q, k, cos, sin, pos, q_out=qo, k_out=ko, qk_norm=(qw, kw, 1e-6, offset))
    assert torch.equal(qkv, qkv_before)
    c, s = cos[pos].to(dtype)[:, None, :], sin[pos].to(dtype)[:, None, :]
    fp32 = dtype == torch.float32
    for x, w, y in ((q, qw, rq), (k, kw, rk)):
        # against the torch path (norm, then rope): a 1-ulp norm difference may move the rope
        # output by one ulp of its inputs, so bound in units of the normed magnitudes
        nx = norm_ref(x, w, 1e-6, offset)
        ref = _apply(nx, c, s)
        assert torch.isfinite(y).all()
        nr = nx[..., :rot].double().abs()
        mag = nr[..., : rot // 2] + nr[..., rot // 2:]
        bound = torch.cat((mag, mag, nx[..., rot:].double().abs()), -1)
        tol = (4 if not fp32 else 64) * U[dtype] * bound + 1e-30
        assert ((y.double() - ref.double()).abs() <= tol).all()
        # against the two separate kernels: identical up to the norm's summation order
        normed = rms_norm(x, w, 1e-6, offset)
        sep = apply_rope(normed, normed, cos, sin, pos)[0]
        assert ((y.double() - sep.double()).abs() <= tol).all()


# ---------------------------------------------------------------------------------- act * mul

ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"),
        "gelu": F.gelu}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 6144), (9, 2 * 6144), (64, 2 * 1536), (3, 2 * 1001),
                                   (1, 2 * 13), (2, 3, 2 * 96)])
@pytest.mark.parametrize("act", list(ACTS))
def test_act_and_mul(dtype, shape, act):
    from kvfit.kernels.fused_act import act_and_mul

    gen = seed_of(dtype, shape, act)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype).to(DEV)
    x[..., 0] = -200.0  # exp overflow path: act -> -0
    x_before = x.clone()
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype)
    y = act_and_mul(x, act, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(x, x_before)
    g, u = x.chunk(2, dim=-1)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    g64, u64 = g.double(), u.double()
    a64 = ACTS[act](g64)
    ref = a64 * u64
    # float64: act rounded (u) then the product rounded (u), plus float32 exp/erf error and the
    # cancellation in 1 + erf for x << 0
    slack = 64 * 2.0 ** -24 * (g64.abs() + 1) * u64.abs() + 4 * U[dtype] * torch.finfo(dtype).tiny
    err = (y.double() - ref).abs()
    assert (err <= 3 * U[dtype] * ref.abs() + slack).all()
    # torch's own path (its tanh-GeLU cancels in 1 + tanh for x << 0, 1e-7 absolute)
    tref = (ACTS[act](g) * u).double()
    assert ((y.double() - tref).abs() <= 5 * U[dtype] * tref.abs() + 2 * slack).all()
    if act == "silu" and dtype != torch.float32:
        assert (y != ACTS[act](g) * u).double().mean().item() <= 0.02


def test_silu_and_mul_alias():
    from kvfit.kernels.fused_act import act_and_mul, gelu_tanh_and_mul, silu_and_mul

    x = torch.randn(5, 2 * 768, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(silu_and_mul(x), act_and_mul(x, "silu"))
    assert torch.equal(gelu_tanh_and_mul(x), act_and_mul(x, "gelu_pytorch_tanh"))


# ---------------------------------------------------------------------------------- models


class _CausalAttention:
    """A backend stand-in: causal attention over this call's tokens (one sequence)."""

    def kv_store_target(self, layer_id):
        return None  # no pool: the model calls forward with k and v (the unfused path)

    def forward(self, q, k, v, layer_id):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), is_causal=True)
        return o.transpose(0, 1).to(q.dtype).contiguous()


def _tiny(model_type):
    from transformers import CONFIG_MAPPING

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
    if model_type == "gemma3_text":
        from kvfit.models.gemma3 import Gemma3ForCausalLM

        cfg = CONFIG_MAPPING[model_type](sliding_window=64, query_pre_attn_scalar=64, **common)
        return Gemma3ForCausalLM(cfg, 512)
    from kvfit.models.llama import LlamaForCausalLM

    cfg = CONFIG_MAPPING[model_type](rope_theta=1e6, **common)
    return LlamaForCausalLM(cfg, 512)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_cuda_matches_cpu(model_type, dtype):
    """The layers dispatch to the kernels on CUDA: same model, CUDA vs the CPU torch path."""
    torch.manual_seed(0)
    m = _tiny(model_type)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                base = 0.0 if model_type.startswith("gemma") else 1.0  # gemma: (1 + w)
                p.copy_(base + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    m = m.to(dtype).eval()
    ctx = SimpleNamespace(backend=_CausalAttention())
    ids = torch.randint(0, 256, (23,))
    pos = torch.arange(23)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs comparable to the CPU's
    try:
        with torch.no_grad():
            ref = m(ids, pos, ctx).double()
            m = m.to(DEV)
            got = m(ids.to(DEV), pos.to(DEV), ctx).double().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    rel = ((got - ref).norm() / ref.norm()).item()
    assert math.isfinite(rel) and rel < (1e-4 if dtype == torch.float32 else 3e-2), rel
