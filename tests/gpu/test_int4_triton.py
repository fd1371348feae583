"""int4 KV on the triton backend, on the GPU: the backend's steps (decode store kernel, decode
kernel, prefill over dequantized pages) against the torch reference backend; the decode store
kernel's bytes against the torch store; and end to end a tiny random-weight Llama (float32
compute) generating the same greedy tokens with the torch backend and the triton backend, eager
and with CUDA graphs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from int4_backend_check import run_steps  # noqa: E402

pytestmark = pytest.mark.gpu

CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
           intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
           torch_dtype="float32", bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("dtype,d,tol", [(torch.float32, 64, 1e-5), (torch.float32, 128, 1e-5),
                                         (torch.bfloat16, 128, 2e-2)])
def test_triton_int4_steps_match_the_torch_backend(dtype, d, tol):
    err = run_steps(torch.device("cuda"), dtype, hq=8, hkv=2, d=d)
    print(f"{dtype} d={d}: largest relative difference {err:.2e}")
    assert err < tol


@pytest.mark.parametrize("d", [64, 128, 256])
def test_triton_int4_token_minor_steps_match_the_torch_backend(d):
    """bfloat16 steps over token-minor V pages: the decode store kernel writes them, decode
    steps run the register kernel (decode_int4_regs_kernel) on Hopper, prefill reads them."""
    err = run_steps(torch.device("cuda"), torch.bfloat16, hq=8, hkv=2, d=d, v_layout="HDN")
    print(f"HDN bf16 d={d}: largest relative difference {err:.2e}")
    assert err < 2e-2


def _generate(path, backend, eager, dtype=None):
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    extra = {} if dtype is None else dict(dtype=dtype)
    llm = LLM(str(path), load_format="dummy", attention_backend=backend, kv_dtype="int4",
              device="cuda", enforce_eager=eager, num_pages=64, max_model_len=512,
              max_num_seqs=8, **extra)
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 33, 70))]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    graphs, layout = llm.engine.runner.graphs, llm.engine.runner.pool.v_layout
    del llm
    torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], graphs, layout


def test_int4_greedy_tokens_triton_equal_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    path = tmp_path / "config.json"
    ref, _, _ = _generate(path, "torch", True)
    for eager in (True, False):
        got, graphs, _ = _generate(path, "triton", eager)
        assert (graphs is None) == eager
        same = 0
        worst = 0.0
        for (rt, rlp), (gt, glp) in zip(ref, got):
            i = next((j for j, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
            for j in range(len(rt) if i is None else i):  # same inputs: same logprobs
                worst = max(worst, abs(rlp[j][rt[j]] - glp[j][gt[j]]))
            if i is None:
                same += 1
            else:  # only a near-tie may go the other way
                gap = sorted(rlp[i].values(), reverse=True)
                assert gap[0] - gap[1] < 0.02, (eager, i, rt, gt, rlp[i], glp[i])
        print(f"eager={eager}: {same}/{len(ref)} identical greedy sequences of 40 tokens, "
              f"largest logprob difference before a divergence {worst:.1e}")
        # float32 attention differs between the backends by rounding (~1e-6); a 4-bit code
        # whose value sits on a rounding boundary can then flip in a later layer, which moves
        # that key element by a whole quantization step: logprobs agree to ~1e-2, not 1e-5
        assert worst < 0.02, (eager, worst)


def test_int4_register_kernel_engine_matches_token_major_pools(tmp_path, monkeypatch):
    """bfloat16 engines, CUDA graphs on: a pool with token-minor V decoded by the register
    kernel (REGS_DEFAULT_ON listing every GPU) against the token-major pool's Gluon kernel
    (REGS_DEFAULT_ON empty), the same greedy tokens up to near-ties and logprobs within
    bfloat16 noise."""
    from kvfit.kernels import decode_int4

    if not decode_int4.gluon_available():
        pytest.skip("the register int4 decode needs a Hopper GPU and Gluon's Hopper module")
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    path = tmp_path / "config.json"
    monkeypatch.setattr(decode_int4, "REGS_DEFAULT_ON", {})  # token-major V, the first kernel
    ref, _, ref_layout = _generate(path, "triton", False, "bfloat16")
    monkeypatch.setattr(decode_int4, "REGS_DEFAULT_ON", {"": frozenset({64})})
    got, graphs, layout = _generate(path, "triton", False, "bfloat16")
    assert graphs is not None and (ref_layout, layout) == ("HND", "HDN")
    assert not decode_int4._gluon_failures  # the register kernel ran, not the fallback
    worst = 0.0
    for (rt, rlp), (gt, glp) in zip(ref, got):
        i = next((j for j, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
        for j in range(len(rt) if i is None else i):
            worst = max(worst, abs(rlp[j][rt[j]] - glp[j][gt[j]]))
        if i is not None:
            gap = sorted(rlp[i].values(), reverse=True)
            assert gap[0] - gap[1] < 0.1, (i, rt, gt, rlp[i], glp[i])
    print(f"largest logprob difference before a divergence {worst:.1e}")
    assert worst < 0.1


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.bfloat16, 128),
                                     (torch.float32, 256)])
def test_int4_decode_store_kernel_equals_the_torch_store(dtype, d):
    from int4_store_check import run_store_check

    assert not run_store_check(torch.device("cuda"), dtype, d=d)
    assert not run_store_check(torch.device("cuda"), dtype, d=d, v_layout="HDN")


@pytest.mark.parametrize("v_layout", ["HND", "HDN"])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.bfloat16, 128),
                                     (torch.float16, 256), (torch.float32, 128)])
def test_int4_prefill_store_and_dequant_kernels_equal_the_torch_pool(dtype, d, v_layout):
    from int4_store_check import run_pages_check

    bad = run_pages_check(torch.device("cuda"), dtype, v_layout, d=d)
    assert not bad, bad
