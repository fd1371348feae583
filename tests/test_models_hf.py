"""kvfit's models against HF transformers on the same weights (float32, tiny random configs)."""

from __future__ import annotations

import zlib

import pytest
import torch

from modelhelpers import TINY, make_hf_model, rel_err, stepwise_logits

from kvfit.config import EngineConfig
from kvfit.engine.runner import ModelRunner


def _runner(model_dir, **kw):
    return ModelRunner(EngineConfig(model=model_dir, device="cpu", num_pages=64, page_size=4, **kw))


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _check(runner, hf, prompt, steps=6, chunk=None):
    logits, toks = stepwise_logits(runner, prompt, steps, chunk)
    ref = _hf_logits(hf, prompt + toks)  # [len, V]
    for i, lg in enumerate(logits):
        pos = len(prompt) - 1 + i
        assert rel_err(lg, ref[pos]) < 1e-4, (i, rel_err(lg, ref[pos]))
    # greedy tokens identical to HF's generate
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    # HF's generate stops at EOS; ours ran on: equal up to (and including) HF's last token
    assert len(gen) == steps or gen[-1] == hf.generation_config.eos_token_id
    assert toks[: len(gen)] == gen


@pytest.mark.parametrize("arch", list(TINY))
def test_logits_match_hf(tiny_models, arch):
    d, hf = tiny_models[arch]
    g = torch.Generator().manual_seed(zlib.crc32(arch.encode()) % 1000)
    prompt = torch.randint(0, TINY[arch]["vocab_size"], (13,), generator=g).tolist()
    runner = _runner(d)
    _check(runner, hf, prompt)
    _check(runner, hf, prompt, chunk=5)  # chunked prefill over a cached prefix


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "rope_theta": 10000.0},
])
def test_rope_scaling_matches_hf(tmp_path, rope):
    hf = make_hf_model("llama", tmp_path, seed=3, rope_parameters=rope)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (40,), generator=g).tolist()
    _check(_runner(str(tmp_path)), hf, prompt, steps=4)
