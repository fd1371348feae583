"""The batch-1 GEMV (kernels/gemv.py) on the GPU: against float64 products and the unfused
kernels at Qwen3-1.7B's layer shapes. (The decode step's path is models/decode_rows.py, tested in
test_rows_gemm_cuda.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvhelpers import DEV

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

