"""The L2 prefetch's host side on CPU: refused where the instruction does not exist, too many
ranges refused with a clear error, and the GEMV path's prefetch helper a no-op off CUDA."""

from __future__ import annotations

import pytest
import torch

from kvfit.kernels import l2_prefetch
from kvfit.models import decode_rows


def test_cpu_has_no_bulk_prefetch():
    assert not l2_prefetch.supports(torch.device("cpu"))


def test_too_many_ranges_are_refused():
    t = torch.randn(64)
    with pytest.raises(ValueError, match="at most 3 ranges"):
        l2_prefetch.prefetch_l2([(t, 0, 16)] * 4)


def test_next_weights_helper_is_a_no_op_on_cpu():
    w_o, w_gu = torch.randn(8, 8), torch.randn(16, 8)
    keep = (w_o.clone(), w_gu.clone())
    decode_rows._prefetch_next_weights(w_o, w_gu, 1 << 20)
    assert torch.equal(w_o, keep[0]) and torch.equal(w_gu, keep[1])
