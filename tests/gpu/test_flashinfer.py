"""The fi backend (FlashInfer) vs the float32 reference: decode, prefill/extend and mixed steps,
per KV dtype, page size and GQA layout; caches compared bit for bit with the torch store."""

from __future__ import annotations

import pytest
import torch

from kvhelpers import BOUND, backend_step, make_pool, random_tables, rel_err

pytestmark = pytest.mark.gpu

LAYOUTS = [(16, 8, 128), (32, 8, 128), (9, 3, 64)]  # group 2 (CUDA cores), 4 (tensor cores), 3
CASES = {
    "decode": ([1, 1, 1, 1], [1, 77, 300, 1500]),
    "mixed": ([37, 1, 20, 130], [37, 50, 83, 300]),
}


def _fi():
    from kvfit.attention.flashinfer_backend import FlashInferBackend

    why = FlashInferBackend.is_available()
    if why:
        pytest.skip(why)
    return FlashInferBackend


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", list(CASES))
def test_fi_vs_reference(kv_dtype, page_size, layout, mode):
    if kv_dtype == "float16" and layout != (16, 8, 128):
        pytest.skip("float16 covered on one layout (each combination is a JIT build)")
    cls = _fi()
    torch.manual_seed(3)
    hq, hkv, d = layout
    q_lens, kv_lens = CASES[mode]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 2
    scales = (0.7, 1.9) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, page_size, hkv, d, num_pages, *scales)
    tables = random_tables(kv_lens, page_size, num_pages, seed=1)
    cdt = torch.float16 if kv_dtype == "float16" else torch.bfloat16
    out, ref = backend_step(cls, pool, q_lens, kv_lens, tables, hq, cdt, d ** -0.5)
    err = rel_err(out, ref)
    assert err < BOUND[cdt], err
