"""The triton backend over the hybrid sliding-window pool on the CPU, under Triton's interpreter,
against the torch reference backend: windows shorter and longer than the prompts, chunks that
cross the window edge, decode past freed sliding pages, token-major and token-minor V pages,
float32/float16 pools (store kernel included) and fp8 pools (read path: the interpreter's fp8
cast rounds differently from torch's, so K/V are stored by the pool's torch store)."""

from __future__ import annotations

import pytest
import torch

import triton_interp

if not triton_interp.enable():
    pytest.skip("a CUDA machine runs the compiled kernels (tests/gpu/test_swa_triton_cuda.py)",
                allow_module_level=True)

from swa_cases import run_case, window_schedule  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("kv_dtype,compute,page,window,v_layout", [
    ("float32", torch.float32, 4, 7, "HND"),
    ("float16", torch.float16, 4, 20, "HND"),
    ("float16", torch.float16, 8, 7, "HDN"),
])
def test_triton_swa_matches_torch_interpreted(kv_dtype, compute, page, window, v_layout):
    sched = window_schedule([13, 9], 5, 10)  # window 7: the prompts cross it; 20: they do not
    errs = run_case(CPU, kv_dtype, compute, page, window, sched, v_layout=v_layout)
    tol = 1e-5 if compute == torch.float32 else 4e-3
    assert max(errs) < tol, errs


@pytest.mark.parametrize("kv_dtype,page,v_layout", [("fp8_e4m3", 8, "HDN"),
                                                    ("fp8_e5m2", 4, "HND")])
def test_triton_swa_fp8_read_path_interpreted(kv_dtype, page, v_layout):
    sched = window_schedule([13, 9], 5, 10)
    errs = run_case(CPU, kv_dtype, torch.float16, page, 7, sched, v_layout=v_layout,
                    store_with_pool=True)
    assert max(errs) < 4e-3, errs
