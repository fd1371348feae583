"""Tensor parallelism beyond the Llama family, on CPU (gloo, 2 processes): tiny random Gemma 3
(sliding-window hybrid pool, q/k norms, four norms per layer), Gemma 2 (attention and final
soft-capping) and DeepSeek-V2 (MLA with the latent cached whole on every rank; MoE experts'
intermediate sharded) give the same greedy tokens at TP=2 as at TP=1 on the same safetensors
checkpoint, with chunked prefill (5-token steps) past the sliding window, and logprobs within
the float32 reordering tolerance of tests/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from kvfit import LLM, SamplingParams

from test_gemma3 import _tiny_cfg as gemma_cfg, tiny_tokenizer_dir
from test_mla import _tiny_cfg as mla_cfg
from test_tensor_parallel import LOGPROB_TOL, _max_logprob_gap

PAGE = 4


def _checkpoint(tmp_path, kind: str, **overrides) -> tuple[str, int]:
    """A random HF model of the tiny ``kind`` config (fields replaced by ``overrides``) saved as
    safetensors (+ a tokenizer); (directory, vocabulary size). float32."""
    import transformers

    if kind.startswith("gemma"):
        cfg = gemma_cfg(kind)
        cls = (transformers.Gemma3ForCausalLM if kind == "gemma3"
               else transformers.Gemma2ForCausalLM)
    else:
        cfg = mla_cfg(kind.split("-")[1])
        cls = transformers.DeepseekV2ForCausalLM
    for name, value in overrides.items():
        setattr(cfg, name, value)
    torch.manual_seed(7)
    hf = cls(cfg).eval()
    with torch.no_grad():  # fresh, not-small weights everywhere (norms included)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if kind.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.08)
    d = tmp_path / kind
    hf.save_pretrained(str(d), safe_serialization=True)
    tiny_tokenizer_dir(d, cfg.vocab_size)
    return str(d), cfg.vocab_size


def _generate(path: str, tp: int, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    with LLM(path, device="cpu", num_tokens=256, max_model_len=128, page_size=PAGE,
             max_num_batched_tokens=5, tensor_parallel_size=tp, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.engine.runner
        pool = runner.pool
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
        if pool.sliding_pages is not None:
            assert pool.sliding_pages.num_used == 0
        return outs, pool.name, [l.num_kv_heads for l in pool.layers]


@pytest.mark.parametrize("kind,pool,kv_heads", [
    ("gemma3", "HybridSWAKVCache", 1),  # 2 KV heads over 2 ranks: one each
    ("gemma2", "HybridSWAKVCache", 1),
    ("mla-lite", "MLAKVCache", 1),  # one latent slab per token, whole on every rank
    ("mla-v2", "MLAKVCache", 1),
])
def test_tp2_equals_tp1(tmp_path, kind, pool, kv_heads):
    path, vocab = _checkpoint(tmp_path, kind)
    g = torch.Generator().manual_seed(3)
    # 13 and 9 tokens in 5-token chunks: prefill crosses chunk and (Gemma) window boundaries,
    # decoding 12 more goes well past the 5/6-token sliding windows
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 9, 3)]
    one, pool_one, heads_one = _generate(path, 1, prompts)
    two, pool_two, heads_two = _generate(path, 2, prompts)
    assert pool_one == pool_two == pool
    assert set(heads_two) == {kv_heads}
    if pool == "MLAKVCache":
        assert heads_two == heads_one  # the latent is not split
    else:
        assert sum(heads_two) * 2 == sum(heads_one)  # each rank holds half of the KV heads
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert _max_logprob_gap(two, one) < LOGPROB_TOL


def test_bench_seed_points_run_every_rank(tmp_path, monkeypatch):
    """``kvfit bench seed --tensor-parallel-size 2``'s path on CPU: ``collective_call`` fills
    every rank's pool (poisoned with NaN first: every rank's pool is finite afterwards), the
    timed points run through ``run_plan`` (rank 0's sliding lists sent to the worker) and
    the runner closes cleanly."""
    import math
    import os

    import tp_probe

    from kvfit.bench.seed_points import decode_point, fill_pool_of, prefill_point
    from kvfit.config import EngineConfig
    from kvfit.engine.runner import ModelRunner

    here = os.path.dirname(os.path.abspath(__file__))  # the worker imports tp_probe
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path, _ = _checkpoint(tmp_path, "gemma3")
    cfg = EngineConfig(model=path, device="cpu", num_pages=32, page_size=PAGE,
                       max_model_len=64, max_num_batched_tokens=32, tensor_parallel_size=2)
    runner = ModelRunner(cfg)
    try:
        runner.collective_call(tp_probe.poison_pool)
        assert all(math.isnan(s) for s in runner.collective_call(tp_probe.pool_sums))
        runner.collective_call(fill_pool_of)
        sums = runner.collective_call(tp_probe.pool_sums)
        assert len(sums) == 2 and all(math.isfinite(s) and s > 0 for s in sums)
        assert decode_point(runner, 2, 9, 2) > 0
        assert prefill_point(runner, 20, repeats=2) > 0
        assert runner.pool.sliding_pages.num_used == 0
        sums = runner.collective_call(tp_probe.pool_sums)  # every rank still in step
        assert all(math.isfinite(s) for s in sums)
    finally:
        runner.close()


@pytest.fixture(scope="module")
def llama_hd32(tmp_path_factory):
    """A tiny Llama with 32-wide heads (int4 packs K per 32 channels) and a tokenizer."""
    from modelhelpers import make_hf_model

    d = tmp_path_factory.mktemp("tp-llama-hd32")
    make_hf_model("llama", d, hidden_size=128, head_dim=32)
    tiny_tokenizer_dir(d, 256)
    return str(d)


@pytest.mark.parametrize("kv_dtype,calibration", [("int8", "start"), ("int8", "file"),
                                                  ("int4", None)])
def test_tp2_equals_tp1_int8_and_int4(llama_hd32, tmp_path, kv_dtype, calibration):
    """int8: the K means calibrated at start by every rank together (rank 0's text ids, each
    rank its KV heads) or loaded from a whole-model file (each rank its heads' rows), the V
    rotation folded into each rank's v/o shards; int4: the residual slots rank 0's scheduler
    assigns travel in the step message. Greedy tokens and logprobs as at TP=1."""
    kw = dict(kv_dtype=kv_dtype, page_size=32, num_tokens=512, max_model_len=256,
              max_num_batched_tokens=16)
    if calibration == "file":
        from kvfit.engine.write_kv_calibration import main as write_calibration

        path = str(tmp_path / "k_mean.json")
        assert write_calibration(["--model", llama_hd32, "--out", path, "--device", "cpu"]) == 0
        kw["kv_calibration"] = path
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (40, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = {}
    for tp in (1, 2):
        with LLM(llama_hd32, device="cpu", tensor_parallel_size=tp, **kw) as llm:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
    assert ([o.outputs[0].token_ids for o in outs[2]]
            == [o.outputs[0].token_ids for o in outs[1]])
    assert _max_logprob_gap(outs[2], outs[1]) < LOGPROB_TOL
