"""How far the real Gemma-3-270M's greedy tokens move with the compute dtype, the KV dtype and
the attention backend on the GPU, against the torch backend in float32 compute and KV: for each
of ``tests/gpu/test_swa_triton_cuda._prompts()`` (random tokens, 700 / 90 / 530, crossing the
512-token window) the tokens equal to the reference's before the first difference, and the
largest difference of the chosen token's logprob before it; then torch against triton at each
KV dtype. Eager steps, 40 greedy tokens.

Usage (GPU machine, the GGUF staged as docs/benchmarks.md describes):
    KVFIT_GEMMA3_GGUF=/tmp/stage/g.gguf PYTHONPATH=src python3 benchmarks/engine/gemma3_real_diag.py
Prints one line per (run, prompt).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "gpu"))
from test_swa_triton_cuda import _generate, _prompts  # noqa: E402

from kvfit.llm import LLM  # noqa: E402

RUNS = [("ref", "torch", "float32", "float32"), ("torch-bf16", "torch", "bfloat16", "bfloat16"),
        ("triton-bf16", "triton", "bfloat16", "bfloat16"),
        ("torch-fp8", "torch", "fp8_e4m3", "bfloat16"),
        ("triton-fp8", "triton", "fp8_e4m3", "bfloat16")]


def _agreement(a, b) -> tuple[int, float]:
    """(tokens equal before the first difference, max |chosen logprob difference| before it)."""
    (at, alp), (bt, blp) = a, b
    i = next((j for j, (x, y) in enumerate(zip(at, bt)) if x != y), None)
    n = len(at) if i is None else i
    return n, max((abs(alp[j][at[j]] - blp[j][bt[j]]) for j in range(n)), default=0.0)


def main() -> None:
    path = os.environ["KVFIT_GEMMA3_GGUF"]
    prompts = _prompts()
    res = {}
    for name, backend, kv, dtype in RUNS:
        llm = LLM(path, attention_backend=backend, kv_dtype=kv, dtype=dtype, device="cuda",
                  enforce_eager=True, num_pages=160, max_model_len=1200,
                  max_num_batched_tokens=256, max_num_seqs=8, seed=3)
        res[name] = _generate(llm, prompts, 40)
        del llm
        torch.cuda.empty_cache()
        if name != "ref":
            for k, (a, b) in enumerate(zip(res["ref"], res[name])):
                n, d = _agreement(a, b)
                print(f"{name} prompt {k}: same tokens for {n}/40, max |dlogprob| before {d:.3f}",
                      flush=True)
    for a, b in [("torch-fp8", "triton-fp8"), ("torch-bf16", "triton-bf16")]:
        for k, (x, y) in enumerate(zip(res[a], res[b])):
            n, d = _agreement(x, y)
            print(f"{a} vs {b} prompt {k}: same for {n}/40, max |dlogprob| {d:.3f}", flush=True)


if __name__ == "__main__":
    main()
