"""The row kernels' shared argument checks (kernels/rows_args.py): what gemv and rows_gemm
accept, and the errors that name what is wrong."""

import pytest
import torch

from kvfit.kernels.rows_args import fits, gated_width, norm_prologue


def test_fits_wants_16_bit_rows_and_a_row_major_weight_of_their_dtype():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    assert fits(x, w)
    assert not fits(x.float(), w.float())  # float32
    assert not fits(x, w.half())  # another dtype
    assert not fits(x, w.t().contiguous().t())  # column-major
    assert not fits(x[:0], w)  # no rows
    assert not fits(x, torch.randn(32, 48, dtype=torch.bfloat16))  # K differs


def test_gated_width_halves_and_names_the_kernel():
    assert gated_width("gemv", 96, None) == 96
    assert gated_width("gemv", 96, "silu") == 48
    with pytest.raises(ValueError, match="gated rows_gemm wants an even row count"):
        gated_width("rows_gemm", 95, "silu")
    with pytest.raises(ValueError, match="'relu'"):
        gated_width("gemv", 96, "relu")


def test_norm_prologue_arguments_and_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    nw = torch.rand(64, dtype=torch.bfloat16)
    assert norm_prologue(x, 64, None, None) == (x, 0.0, 0.0, False)
    w, eps, off, add = norm_prologue(x, 64, (nw, 1e-6, 1.0), torch.randn_like(x))
    assert w is nw and (eps, off, add) == (1e-6, 1.0, True)
    assert norm_prologue(x, 64, (nw, 1e-6, 0.0), None)[3] is False  # no residual: no add
    with pytest.raises(ValueError, match=r"norm weight of shape \(32,\) does not match K=64"):
        norm_prologue(x, 64, (nw[:32], 1e-6, 0.0), None)
    with pytest.raises(ValueError, match="residual .* does not match x"):
        norm_prologue(x, 64, (nw, 1e-6, 0.0), torch.randn(4, 64, dtype=torch.float16))
