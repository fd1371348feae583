"""The int4 Triton decode kernel under the Triton interpreter (CPU), against the float64 reference
over the same int4 pages and residual: kv lengths ending mid-page, on a page boundary, only in
the residual; GQA groups; head_dim 64; 1, 2 and 4 pages per tile, K's scale folded into the
query or not, K's scale loaded per page or per token; the float32 path (exact) and the
16-bit path (float16 values; the interpreter's float16 products set its tolerance); token-minor
V pages (``v_layout`` "HDN"). Runs in a
subprocess because TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import pytest

from interpret_run import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype,splits,npg,variant,rtol", [
    ("float32", 1, 2, "", 1e-5), ("float32", 3, 4, "ks_tokens=True", 1e-5),
    ("float32", 3, 1, "fold_k=True", 1e-5),
    ("bfloat16", 2, 2, "", 1.5e-2), ("float32", 3, 2, "v_layout='HDN'", 1e-5),
    ("bfloat16", 1, 2, "v_layout='HDN'", 1.5e-2)])
def test_int4_decode_kernel_matches_reference_in_the_interpreter(dtype, splits, npg, variant,
                                                                 rtol):
    code = ("import torch; from int4_kernel_check import run_check; "
            f"print(run_check(torch.device('cpu'), torch.{dtype}, [77, 64, 5, 33, 130], 4, 2, "
            f"64, {rtol}, num_splits={splits}, pages_per_tile={npg}, {variant}))")
    print("relative error", run_interpreted(code).strip())
