"""The batch-1 GEMV (kernels/gemv.py) and the one-token decoder path (models/one_token.py) on
the GPU: against float64 products and the unfused kernels at Qwen3-1.7B's layer shapes, and a
tiny Llama's batch-1 greedy decode (eager and CUDA graph) equal to the batched path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvhelpers import DEV
from test_cuda_graph import generate, make_backend, tiny_model

pytestmark = pytest.mark.gpu
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # relative spacing, upper bound
SHAPES = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (100, 72)]  # (N, K)


def _within(y, ref, dtype, roundings):
    tol = roundings * ULP[dtype] * ref.abs() + 1e-4 * ref.abs().max()
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), (int(bad.sum()), y[bad][:4], ref[bad][:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64(dtype, n, k):
    from kvfit.kernels.gemv import gemv

    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype)
    y = gemv(x, w, b)
    _within(y, x.double() @ w.double().t() + b.double(), dtype, 1)
    # and with cuBLAS, as a whole: element-wise, two roundings are not guaranteed where the bias
    # cancels the product (the bf16 100 x 72 case failed in round B, its message cut off)
    ref = F.linear(x, w, b).double()
    assert (y.double() - ref).norm() <= ULP[dtype] * ref.norm()


@pytest.mark.parametrize("n,k,gated", [(4096, 2048, False), (12288, 2048, True),
                                       (48, 72, True)])
def test_fused_norm_and_act_match_unfused_kernels(n, k, gated):
    from kvfit.kernels.fused_act import act_and_mul
    from kvfit.kernels.fused_norm import fused_add_rms_norm
    from kvfit.kernels.gemv import gemv

    dtype = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    r = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    y, s = gemv(x, w, norm=(nw, 1e-6, 0.0), residual=r, gated_act="silu" if gated else None)
    h, s_ref = fused_add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(s, s_ref)  # the new residual, bit for bit
    assert y.shape == (1, n // 2 if gated else n)
    # the kernel's math in float64: W (w_norm * s) / rms(s)
    s64 = s.double()
    h64 = s64 * torch.rsqrt((s64 * s64).mean() + 1e-6) * nw.double()
    exact = h64 @ w.double().t()
    unfused = h.double() @ w.double().t()  # the unfused kernels round the normed input twice
    if gated:
        g, u = exact.chunk(2, dim=-1)
        exact = F.silu(g) * u
        unfused = act_and_mul(unfused.to(dtype), "silu").double()
        _within(y, exact, dtype, 4)
    else:
        _within(y, exact, dtype, 1)
    assert (y.double() - unfused).norm() <= 2 * ULP[dtype] * unfused.norm()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("pdl_on", [False, True])
def test_one_token_path_decodes_like_the_batched_path(kv_dtype, pdl_on):
    """Greedy tokens of one request: batched path (one_token off, PDL off) == one-token path,
    eager and graphed, with programmatic dependent launch off and on."""
    from kvfit.engine.cuda_graph import DecodeGraphs
    from kvfit.kernels import pdl
    from kvfit.models import one_token

    torch.manual_seed(0)
    cfg, model = tiny_model(128)
    ps, num_pages = 16, 64
    prompts = [torch.randint(0, 512, (23,)).tolist()]
    tables = [list(range(3, 3 + 200 // ps + 1))]
    defaults = one_token.ENABLED, pdl.ENABLED
    try:
        one_token.ENABLED, pdl.ENABLED = False, False
        ctx = make_backend("triton", cfg, model, kv_dtype, num_pages, ps)
        ref = generate(model, ctx, prompts, tables, 12)
        one_token.ENABLED, pdl.ENABLED = True, pdl_on
        ctx = make_backend("triton", cfg, model, kv_dtype, num_pages, ps)
        x = torch.randn(1, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
        assert one_token.applies(model.model.layers[0], x, None)
        eager = generate(model, ctx, prompts, tables, 12)
        ctx_g = make_backend("triton", cfg, model, kv_dtype, num_pages, ps)
        graphs = DecodeGraphs(model, ctx_g, 1, 200 // ps + 1, DEV)
        graphed = generate(model, ctx_g, prompts, tables, 12, graphs)
    finally:
        one_token.ENABLED, pdl.ENABLED = defaults
    assert eager == ref
    assert graphed == ref
