"""The int4 Triton decode kernel on the GPU against the float64 reference over the same int4
pages and residual (bf16 queries and residual): head_dim 64/128/256, GQA groups 1/3/8, lengths
ending mid-page, on a page boundary and inside the first page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from int4_kernel_check import run_check  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hq,hkv,d,splits", [(9, 3, 64, 1), (16, 8, 128, 1), (8, 1, 256, 1),
                                              (9, 3, 64, 4), (16, 8, 128, 4)])
def test_int4_decode_matches_reference(hq, hkv, d, splits):
    err = run_check(torch.device("cuda"), torch.bfloat16, [1000, 512, 7, 33, 2049, 64], hq, hkv,
                    d, 5e-3, num_splits=splits)
    print(f"hq={hq} hkv={hkv} d={d} splits={splits}: relative error {err:.2e}")
