"""fp8_e4m3 KV on the bundled real model against bf16 KV: greedy agreement on the quality bench's
12 prompts, and next-token KL on the shipped text.

Floors from the measured numbers (`kvfit bench quality --model smollm2-135m`, docs/benchmarks.md):
e4m3 gave 4/12 token-identical 48-token answers, first divergence median 19 tokens, and a mean KL
of 0.0096 over 3,000 tokens. A broken fp8 path (wrong scale, NaN, unsaturated overflow) diverges
at the first tokens of every prompt and has KL >> 0.1. The test asserts half the measured
agreement (>= 2/12 identical, median first divergence >= 8) and KL below 3x the measured mean.
"""

from __future__ import annotations

import statistics

import torch

from kvfit import LLM, SamplingParams
from kvfit.bench.quality import PROMPTS, chat_prompts, quality_text, sequence_logprobs


def _run(kv_dtype):
    llm = LLM("smollm2-135m", device="cpu", kv_dtype=kv_dtype, num_tokens=8192,
              max_model_len=2048, max_num_batched_tokens=512)
    tok = llm.get_tokenizer()
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts(tok)],
                        SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    ids = tok(quality_text())["input_ids"][:400]
    lps = torch.cat(list(sequence_logprobs(llm.engine, ids, 512)))
    return [o.outputs[0].token_ids for o in outs], lps


def test_fp8_e4m3_agrees_with_bf16_kv():
    base, base_lp = _run("bfloat16")
    fp8, fp8_lp = _run("fp8_e4m3")
    identical = sum(a == b for a, b in zip(fp8, base))
    divergence = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(fp8, base) if a != b]
    print(f"fp8_e4m3 vs bf16 KV: {identical}/{len(PROMPTS)} identical, first divergence "
          f"{sorted(divergence)}")
    assert identical >= 2
    assert not divergence or statistics.median(divergence) >= 8
    kl = (base_lp.exp() * (base_lp - fp8_lp)).sum(-1)  # KL(bf16 || fp8) per position
    print(f"KL mean {kl.mean():.4f} max {kl.max():.3f}")
    assert torch.isfinite(fp8_lp).all() and kl.mean() < 0.03
