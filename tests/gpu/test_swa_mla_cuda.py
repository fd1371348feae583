"""HybridSWAKVCache and MLAKVCache on CUDA with the torch reference backend: float32 logits match
HF transformers on the GPU (tiny Gemma 3 and DeepSeek-V2 configs, past the window), and bf16
compute with fp8 pools stays finite and close to a bf16 pool (same tolerances as the CPU tests)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from modelhelpers import chunked_schedule, random_sequences  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _check(hf, drive, ours, cfg, seqs, sched):
    got = drive(ours, cfg, seqs, sched, device="cuda")[0]
    for seq, g in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0].float()
        rel = ((g - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"relative logit error {rel:.2e}"
    ours_bf16 = ours.to(torch.bfloat16)
    base = drive(ours_bf16, cfg, seqs, sched, kv_dtype="bfloat16", device="cuda",
                 compute_dtype=torch.bfloat16)[0]
    for name, tol in (("fp8_e4m3", 0.05), ("fp8_e5m2", 0.10)):
        q = drive(ours_bf16, cfg, seqs, sched, kv_dtype=name, device="cuda",
                  compute_dtype=torch.bfloat16)[0]
        for b, x in zip(base, q):
            assert torch.isfinite(x).all()
            rel = ((x - b).abs().max() / b.abs().max()).item()
            assert rel < tol, f"{name}: rel {rel:.3f} vs bf16 pool"


def test_gemma3_hybrid_pool_cuda():
    import test_gemma3 as tg

    cfg, hf, ours = tg._hf_and_ours("gemma3")
    seqs = random_sequences(cfg, [13, 7], 16)
    _check(hf.cuda(), tg.drive_hybrid, ours.cuda(), cfg, seqs, chunked_schedule([13, 7], 5, 16))


def test_mla_pool_cuda():
    import test_mla as tm

    cfg, hf, ours = tm._hf_and_ours("lite")
    seqs = random_sequences(cfg, [11, 6], 16)
    _check(hf.cuda(), tm.drive_mla, ours.cuda(), cfg, seqs, chunked_schedule([11, 6], 4, 16))
