"""Shared fixtures: tiny random HF checkpoints per architecture and the bundled real model.
Helpers (tiny configs, the step-by-step logits driver) live in ``modelhelpers.py``: a module
named ``conftest`` cannot be imported reliably, since tests/gpu has its own."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from modelhelpers import TINY, make_hf_model

logging.getLogger("kvfit").setLevel(logging.WARNING)
if not torch.cuda.is_available():
    # kernels run under Triton's interpreter on CPU-only hosts (tests/triton_interp.py); the
    # variable must be set before triton is first imported (its own @jit library functions)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (dir, hf_model)} for every tiny architecture."""
    out = {}
    for arch in TINY:
        d = tmp_path_factory.mktemp(f"tiny-{arch}")
        out[arch] = (str(d), make_hf_model(arch, d))
    return out


@pytest.fixture(scope="session")
def bundled_llm():
    """The bundled SmolLM2-135M in float32 on CPU with the reference backend."""
    from kvfit import LLM

    return LLM("smollm2-135m", device="cpu", num_tokens=16384, max_model_len=2048)


@pytest.fixture(scope="session")
def bundled_hf():
    from transformers import AutoModelForCausalLM

    from kvfit.models.registry import resolve_model

    src = resolve_model("smollm2-135m")
    m = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.path.split("/")[-1],
                                             dtype=torch.float32)
    return m.eval()
