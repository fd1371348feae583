"""The triton backend over the hybrid sliding-window pool on the GPU, against the torch reference
backend: every KV format, pages of 16 and 32, windows shorter and longer than the prompts,
chunked prefill across the window edge, decode past freed sliding pages (random q/k/v, Gemma 3
head shapes, poisoned pools); and end to end, the Gemma-3-270M shape with random weights in
float32 generates the same greedy tokens with the triton backend (eager and CUDA graphs) as with
the torch backend, prompts longer than the 512-token window included."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from swa_cases import run_case, window_schedule  # noqa: E402

pytestmark = pytest.mark.gpu

# every KV format, pages of 16 and 32, a window shorter (40) and longer (400) than the prompts,
# the Gemma-3-270M (4 q : 1 kv) and 4B (8 : 4) head layouts at head_dim 256; a covering subset of
# the product (each case compiles its own kernel variants)
CASES = [("bfloat16", torch.bfloat16, 16, 40, 4, 1), ("bfloat16", torch.bfloat16, 32, 400, 8, 4),
         ("float16", torch.float16, 32, 40, 8, 4), ("float16", torch.float16, 16, 400, 4, 1),
         ("fp8_e4m3", torch.bfloat16, 32, 40, 4, 1), ("fp8_e4m3", torch.bfloat16, 16, 400, 8, 4),
         ("fp8_e5m2", torch.bfloat16, 16, 40, 8, 4), ("fp8_e5m2", torch.bfloat16, 32, 400, 4, 1)]


def _v_layout(kv_dtype, page, head_dim):
    from kvfit.attention.triton_backend import TritonBackend

    return TritonBackend.v_layout(kv_dtype, page, head_dim)


@pytest.mark.parametrize("kv_dtype,compute,page,window,hq,hkv", CASES)
def test_triton_swa_matches_torch(kv_dtype, compute, page, window, hq, hkv):
    # prompts 150/37/90 in chunks of 64: window 40 is crossed inside chunks and pages are freed
    # while prefilling; window 400 is longer than every prompt (then 24 decode steps)
    sched = window_schedule([150, 37, 90], 64, 24)
    errs = run_case("cuda", kv_dtype, compute, page, window, sched, hq=hq, hkv=hkv,
                    head_dim=256, v_layout=_v_layout(kv_dtype, page, 256), seed=page + window)
    assert max(errs) < 2e-2, errs


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_triton_swa_softcap_and_128_heads(kv_dtype):
    """Gemma 2's attention soft-cap (50) and 128-d heads (token-minor fp8 V at 128)."""
    sched = window_schedule([70, 130], 48, 16)
    errs = run_case("cuda", kv_dtype, torch.bfloat16, 16, 64, sched, hq=8, hkv=2, head_dim=128,
                    v_layout=_v_layout(kv_dtype, 16, 128), softcap=50.0)
    assert max(errs) < 2e-2, errs


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_triton_swa_long_context_split_decode(kv_dtype):
    """Contexts long enough for split-K decode: the sliding layer's splits share only the window
    (the full layer's the whole context), prompts prefilled in chunks of 512 across the edge."""
    sched = window_schedule([1100, 600], 512, 6)
    errs = run_case("cuda", kv_dtype, torch.bfloat16, 32, 300, sched, hq=8, hkv=4, head_dim=256,
                    v_layout=_v_layout(kv_dtype, 32, 256))
    assert max(errs) < 2e-2, errs


def gemma_llm(backend, kv_dtype, eager, dtype, model=None):
    """An engine of Gemma-3-270M on the GPU: ``model`` (a GGUF path, the real weights), else the
    shipped config with random weights."""
    from kvfit.attention.registry import unavailable_reason
    from kvfit.bench.configs import config_path
    from kvfit.llm import LLM

    why = unavailable_reason(backend, "cuda")
    if why:
        pytest.skip(why)
    weights = {"load_format": "dummy"} if model is None else {}
    return LLM(model or config_path("gemma3-270m"), **weights, attention_backend=backend,
               kv_dtype=kv_dtype, dtype=dtype, device="cuda", enforce_eager=eager,
               num_pages=160, max_model_len=1200, max_num_batched_tokens=256, max_num_seqs=8,
               cuda_graph_max_bs=4, seed=3)


def _generate(llm, prompts, n):
    from kvfit.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _prompts():
    g = torch.Generator().manual_seed(7)
    # 700 and 530 cross the 512-token window (prefilled in chunks of 256); 90 stays inside
    return [torch.randint(5, 262000, (n,), generator=g).tolist() for n in (700, 90, 530)]


@pytest.mark.parametrize("kv_dtype,dtype,gap", [("float32", "float32", 1e-4),
                                                ("fp8_e4m3", "bfloat16", 0.05)])
def test_gemma3_270m_shape_greedy_triton_equals_torch(kv_dtype, dtype, gap):
    """float32: the same greedy tokens (the engine's whole path: chunked prefill across the
    window, sliding pages released, CUDA-graph decode with the sliding tables). bf16 + fp8:
    tokens may differ only after a near tie of the reference (rounding of the attention)."""
    check_triton_equals_torch(kv_dtype, dtype, gap)


def check_triton_equals_torch(kv_dtype, dtype, gap, model=None):
    """``gemma_llm(model=model)``'s 40 greedy tokens of ``_prompts()`` on the triton backend,
    eager and with CUDA graphs, against the torch backend's: the chosen tokens' logprobs within
    10 x ``gap`` up to the first different token, which must follow a near tie (top-2 gap of
    the reference < ``gap``)."""
    prompts = _prompts()
    llm = gemma_llm("torch", kv_dtype, True, dtype, model)
    ref = _generate(llm, prompts, 40)
    del llm
    torch.cuda.empty_cache()
    for eager in (True, False):
        llm = gemma_llm("triton", kv_dtype, eager, dtype, model)
        assert (llm.engine.runner.graphs is None) == eager
        got = _generate(llm, prompts, 40)
        del llm
        torch.cuda.empty_cache()
        for (rt, rlp), (gt, glp) in zip(ref, got):
            i = next((j for j, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
            for j in range(len(rt) if i is None else i):
                assert abs(rlp[j][rt[j]] - glp[j][gt[j]]) < 10 * gap, (eager, j)
            if i is not None:
                top = sorted(rlp[i].values(), reverse=True)
                assert top[0] - top[1] < gap, (eager, i, rt, gt, rlp[i], glp[i])
