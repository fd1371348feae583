"""The int4 Triton decode kernel under the Triton interpreter (CPU), against the float64 reference
over the same int4 pages and residual: kv lengths ending mid-page, on a page boundary, only in
the residual; GQA groups; head_dim 64. Runs in a subprocess because TRITON_INTERPRET must be set
before Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


@pytest.mark.parametrize("splits", [1, 3])
def test_int4_decode_kernel_matches_reference_in_the_interpreter(splits):
    code = ("import torch; from int4_kernel_check import run_check; "
            "print(run_check(torch.device('cpu'), torch.float32, [77, 64, 5, 33, 130], 4, 2, 64, "
            f"1e-4, num_splits={splits}))")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    print("relative error", r.stdout.strip())
