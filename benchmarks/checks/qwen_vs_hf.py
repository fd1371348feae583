"""One-off check (too slow for CI): kvfit greedy == HF transformers greedy on the real
Qwen2.5-Coder-0.5B-Instruct GGUF, float32 on CPU, 32 new tokens per prompt."""

import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from kvfit import LLM, SamplingParams
from kvfit.models.registry import resolve_model

PROMPTS = ["def quicksort(xs):", "The capital of France is",
           "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n"]

llm = LLM("qwen2.5-coder-0.5b", device="cpu", num_tokens=4096, max_model_len=1024)
outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                    use_tqdm=False)
del llm
src = resolve_model("qwen2.5-coder-0.5b")
hf = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.path.split("/")[-1],
                                          dtype=torch.float32).eval()
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.path.split("/")[-1])
ok = 0
for p, o in zip(PROMPTS, outs):
    ids = torch.tensor([tok(p)["input_ids"]])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            max_new_tokens=32, do_sample=False, pad_token_id=0))[0, ids.shape[1]:].tolist()
    mine = o.outputs[0].token_ids[: len(ref)]
    same = mine == ref
    ok += same
    print(f"{'IDENTICAL' if same else 'DIFFERENT'} ({len(ref)} tokens): {p!r} -> {o.outputs[0].text!r}")
print(f"{ok}/{len(PROMPTS)} prompts identical to HF transformers greedy")
sys.exit(0 if ok == len(PROMPTS) else 1)
