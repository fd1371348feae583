"""Overlap scheduling on CUDA (pinned copies, events, decode inputs gathered from the previous
step's device ids, CUDA-graph replays): the same tokens as the synchronous engine for greedy and
seeded requests stopping at different steps, every page back at the end."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
           intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
           torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def _run(path, mode, kv_dtype, eager, sps, num_pages=128):
    from kvfit.llm import LLM

    llm = LLM(str(path), load_format="dummy", attention_backend="triton", kv_dtype=kv_dtype,
              device="cuda", enforce_eager=eager, num_pages=num_pages, page_size=16,
              max_model_len=min(512, num_pages * 16), async_scheduling=mode, max_num_seqs=8)
    assert llm.engine.overlap == (mode == "on")
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)]
               for i, n in enumerate((5, 33, 70, 17, 9, 120))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    eng = llm.engine
    assert eng.allocator.num_free == eng.allocator.num_pages
    pre = eng.scheduler.num_preemptions
    del llm, eng
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], pre


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("eager", [False, True])
def test_overlap_equals_sync(tmp_path, kv_dtype, eager):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    path = tmp_path / "config.json"
    base = [SamplingParams_(temperature=0, max_tokens=40, ignore_eos=True)] * 6
    ref, _ = _run(path, "off", kv_dtype, eager, base)
    sps = [SamplingParams_(temperature=0, max_tokens=40, ignore_eos=True,
                           stop_token_ids=[ref[i][0][4 + 5 * i]]) for i in range(6)]
    sps[1] = SamplingParams_(temperature=0.8, top_p=0.9, seed=7, max_tokens=33, ignore_eos=True)
    sps[3] = SamplingParams_(temperature=1.0, top_k=20, seed=11, max_tokens=3, ignore_eos=True)
    want, _ = _run(path, "off", kv_dtype, eager, sps)
    got, _ = _run(path, "on", kv_dtype, eager, sps)
    assert got == want
    # a pool of 12 pages for 6 requests of up to 160 tokens forces preemption by recompute
    want, pre = _run(path, "off", kv_dtype, eager, base, num_pages=12)
    got, pre_on = _run(path, "on", kv_dtype, eager, base, num_pages=12)
    assert pre > 0 and pre_on > 0 and got == want


def SamplingParams_(**kw):
    from kvfit.sampling_params import SamplingParams

    return SamplingParams(**kw)
