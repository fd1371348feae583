"""The bundled real model (SmolLM2-135M-Instruct GGUF): kvfit greedy == HF transformers greedy."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from kvfit import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


def test_greedy_matches_transformers(bundled_llm, bundled_hf):
    tok = bundled_llm.get_tokenizer()
    outs = bundled_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                        ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            ref = bundled_hf.generate(ids, attention_mask=torch.ones_like(ids),
                                      generation_config=GenerationConfig(
                                          max_new_tokens=32, do_sample=False, eos_token_id=None,
                                          pad_token_id=2))[0, ids.shape[1]:]
        ref = ref.tolist()  # HF stops at EOS (its generation config); ours ignored EOS
        assert len(ref) == 32 or ref[-1] == 2
        assert out.outputs[0].token_ids[: len(ref)] == ref, prompt


def test_prefill_logits_match_transformers(bundled_llm, bundled_hf):
    """Prompt logprobs (every position) against HF's log-softmax: same function, fp32."""
    tok = bundled_llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 6
    ids = tok(text)["input_ids"]
    out = bundled_llm.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                     prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(bundled_hf(torch.tensor([ids])).logits[0].double(), -1)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]]
        assert abs(got - float(ref[pos - 1, ids[pos]])) < 1e-3, pos
