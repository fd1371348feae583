"""The batch-1 GEMV kernel (kernels/gemv.py) on the CPU under the Triton interpreter, against
float64 references on small shapes: plain, with bias, with the residual-add + RMSNorm prologue,
and with the gated activation epilogue; K not a multiple of the tile; bad input is refused.

float16 is compared at one rounding of the output (the interpreter rounds float16 like the GPU);
bfloat16 at two (the interpreter's float32 -> bfloat16 conversion truncates)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():  # the interpreter flag is process-wide: never set it next to a GPU
    pytest.skip("Triton-interpreter tests run on CPU-only machines; the GPU runs "
                "tests/gpu/test_gemv_cuda.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvfit.kernels.gemv import gemv  # noqa: E402
from kvfit.models.layers import RMSNorm  # noqa: E402

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # relative, per rounding
ROUNDINGS = {torch.float16: 1, torch.bfloat16: 2}


def _close(y: torch.Tensor, ref: torch.Tensor, dtype, extra: float = 0.0) -> None:
    """|y - ref| within the dtype's roundings of |ref| (+ a floor for values near zero)."""
    tol = ROUNDINGS[dtype] * ULP[dtype] * ref.abs() + extra + 1e-3 * ref.abs().max()
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), (y[bad][:5], ref[bad][:5])


def _data(k: int, n: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return x, w, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,block_k", [(96, 32), (80, 32)])  # 80: K not a multiple of the tile
def test_plain_and_bias(dtype, k, block_k):
    x, w, g = _data(k, 20, dtype, 1)
    bias = torch.randn(20, generator=g).to(dtype)
    y = gemv(x, w, config=(8, block_k, 4, 1))  # 20 rows: the last program is partial
    assert y.shape == (1, 20) and y.dtype == dtype
    _close(y, x.double() @ w.double().t(), dtype)
    yb = gemv(x, w, bias, config=(8, block_k, 4, 1))
    _close(yb, x.double() @ w.double().t() + bias.double(), dtype)
    y32 = gemv(x, w, out_dtype=torch.float32, config=(8, block_k, 4, 1))  # LM-head logits
    assert y32.dtype == torch.float32 and torch.equal(y32, y.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue(dtype, with_residual):
    k = 64
    x, w, g = _data(k, 24, dtype, 2)
    r = torch.randn(1, k, generator=g).to(dtype)
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    res = r if with_residual else None
    y, s = gemv(x, w, norm=(norm.weight.data, 1e-6, 0.0), residual=res, config=(8, 32, 4, 1))
    with torch.no_grad():
        h, s_ref = norm(x, r) if with_residual else (norm(x), x)
    if dtype == torch.float16:
        assert torch.equal(s, s_ref)  # the new residual is x + r rounded once
    else:
        _close(s, s_ref.double(), dtype)
    assert not with_residual or s.data_ptr() not in (x.data_ptr(), r.data_ptr())
    # the kernel's math, exactly: W (w_norm * s) / rms(s), s the rounded residual sum it returned
    s64 = s.double()
    h64 = s64 * torch.rsqrt((s64 * s64).mean() + 1e-6) * norm.weight.data.double()
    _close(y, h64 @ w.double().t(), dtype)
    # and the unfused path (input rounded twice) to within a rounding of the input
    ref = h.double() @ w.double().t()
    assert (y.double() - ref).norm() <= 4 * ULP[dtype] * ref.norm()


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_epilogue(act):
    dtype, k, inter = torch.float16, 64, 24
    x, w, g = _data(k, 2 * inter, dtype, 3)
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    y, _ = gemv(x, w, norm=(norm.weight.data, 1e-6, 0.0), gated_act=act, config=(8, 32, 4, 1))
    assert y.shape == (1, inter)
    x64 = x.double()
    h64 = x64 * torch.rsqrt((x64 * x64).mean() + 1e-6) * norm.weight.data.double()
    gate, up = (h64 @ w.double().t()).chunk(2, dim=-1)
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    ref = fn(gate) * up
    _close(y, ref, dtype, extra=4 * ULP[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("block_m", [1, 4])  # the engine's, and a benchmark's masked rows
@pytest.mark.parametrize("fused", ["plain", "norm", "norm_residual", "gated"])
def test_rows_are_batch_invariant(fused, block_m):
    """M token rows: each row has the bits it has alone, wherever it sits in the step (the
    decode path's batch invariance rests on this), at one rows-per-program setting; the
    residual is written once per row."""
    dtype, k, n = torch.float16, 80, 20  # K not a multiple of the tile, a partial last block
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(6, k, generator=g).to(dtype)  # 6 rows: two row blocks at block_m 4
    rs = torch.randn(6, k, generator=g).to(dtype)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    kw = {"plain": {}, "norm": {"norm": (nw, 1e-6, 0.0)},
          "norm_residual": {"norm": (nw, 1e-6, 0.0)},
          "gated": {"norm": (nw, 1e-6, 0.0), "gated_act": "silu"}}[fused]
    cfg = (8, 32, 4, 1)

    def run(rows):
        res = rs[rows] if fused == "norm_residual" else None
        extra = {"residual": res} if res is not None else {}
        return gemv(xs[rows], w, config=cfg, block_m=block_m, **kw, **extra)

    alone = [run([i]) for i in range(6)]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2], [5, 0, 3, 1, 4, 2]):
        out = run(order)
        for j, i in enumerate(order):
            if fused == "plain":
                assert torch.equal(out[j], alone[i][0])
            else:
                assert torch.equal(out[0][j], alone[i][0][0])  # the product
                assert torch.equal(out[1][j], alone[i][1][0])  # the new residual
    if fused == "norm_residual":  # and the residual is x + r rounded once, per row (float16:
        # the interpreter rounds it like the GPU)
        out = run(list(range(6)))
        assert torch.equal(out[1], (xs.float() + rs.float()).to(dtype))


def test_refuses_what_it_cannot_run():
    x = torch.randn(2, 16).half()
    w = torch.randn(8, 16).half()
    with pytest.raises(ValueError, match="16-bit rows"):
        gemv(x[:, :8], w)
    with pytest.raises(ValueError, match="16-bit rows"):
        gemv(x[:1], w.float())
    with pytest.raises(ValueError, match="even row count"):
        gemv(x[:1], w[:7], gated_act="silu")
    with pytest.raises(ValueError, match="float32, not"):
        gemv(x[:1], w, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        gemv(x[:1], w, norm=(torch.ones(8).half(), 1e-6, 0.0))



@pytest.mark.parametrize("m,per_prog", [(1, 2), (3, 3), (3, 7)])
def test_persistent_grid_gives_the_classic_bits(m, per_prog):
    """A tile with a fifth entry (blocks per program) runs the persistent kernel: the same bits
    as the one-program-per-block grid at the same tile, plain with bias and a ragged K, with the
    norm + residual prologue, gated, and float32 logits; fewer programs than blocks."""
    g = torch.Generator().manual_seed(per_prog)
    dtype = torch.bfloat16
    k, n = 80, 40
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    r = torch.randn(m, k, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    tile = (8, 32, 4, 2)
    pers = tile + (per_prog,)
    assert torch.equal(gemv(x, w, b, config=tile), gemv(x, w, b, config=pers))
    for gated in (None, "silu"):
        a = gemv(x, w, norm=(nw, 1e-6, 1.0), residual=r, gated_act=gated, config=tile)
        c = gemv(x, w, norm=(nw, 1e-6, 1.0), residual=r, gated_act=gated, config=pers)
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert torch.equal(gemv(x, w, out_dtype=torch.float32, config=tile),
                       gemv(x, w, out_dtype=torch.float32, config=pers))
