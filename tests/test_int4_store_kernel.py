"""The int4 decode-step store kernel under the Triton interpreter (CPU): the same bytes as the
torch store (``Int4KVCache.store_step``) in float32 and bfloat16. Runs in a subprocess because
TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import pytest

from interpret_run import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype,v_layout", [("float32", "HND"), ("bfloat16", "HND"),
                                            ("bfloat16", "HDN")])
def test_int4_decode_store_kernel_equals_the_torch_store(dtype, v_layout):
    code = ("import torch; from int4_store_check import run_store_check; "
            f"bad = run_store_check(torch.device('cpu'), torch.{dtype}, v_layout='{v_layout}'); "
            "assert not bad, bad")
    run_interpreted(code)


@pytest.mark.parametrize("dtype,v_layout", [("float32", "HND"), ("float16", "HDN")])
def test_int4_prefill_store_and_dequant_kernels_equal_the_torch_pool(dtype, v_layout):
    """``int4_store_pages`` writes the torch quantizer's bytes, ``int4_dequant_pages`` reads back
    the torch reader's values (both V layouts; a constant page; rows not listed untouched).
    Not bfloat16 here: the interpreter casts float32 to bfloat16 by truncation, the GPU and
    torch round to nearest even (tests/gpu/test_int4_triton.py checks bfloat16 there)."""
    code = ("import torch; from int4_store_check import run_pages_check; "
            f"bad = run_pages_check(torch.device('cpu'), torch.{dtype}, '{v_layout}'); "
            "assert not bad, bad")
    run_interpreted(code)
