"""The triton backend's int4 path (attention/triton_int4.py: the residual-plan store, the int4
decode kernel, prefill over dequantized pages) against the torch reference backend on the same
steps, under the Triton interpreter (CPU, float32), over token-major and token-minor V pages.
Runs in a subprocess because TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import pytest

from interpret_run import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("v_layout", ["HND", "HDN"])
def test_triton_int4_backend_matches_the_torch_reference_in_the_interpreter(v_layout):
    code = ("import torch; from int4_backend_check import run_steps; "
            f"err = run_steps(torch.device('cpu'), torch.float32, v_layout='{v_layout}'); "
            "print(err); "
            "assert err < 1e-5, err")
    print("relative difference", run_interpreted(code, timeout=900).strip())
