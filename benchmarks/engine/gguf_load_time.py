"""Wall time of building an ``LLM`` from a GGUF file on the CPU (settings, tokenizer, weights),
then 5 greedy tokens of two random-token prompts, with the GGUF metadata parsed once
(``models/gguf_readers.shared_gguf_readers``, the engine's default) or, with ``--no-share``, once
per reader as before it (four parses).

Usage: python3 benchmarks/engine/gguf_load_time.py [--model gemma3-270m|PATH.gguf] [--no-share]
Prints the load seconds and the tokens (equal with and without sharing).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--no-share", action="store_true")
    args = p.parse_args()
    from kvfit.engine import llm_engine
    from kvfit.llm import LLM
    from kvfit.models.registry import KNOWN_MODELS
    from kvfit.sampling_params import SamplingParams

    path = KNOWN_MODELS[args.model].locate() if args.model in KNOWN_MODELS else args.model
    if args.no_share:
        llm_engine.shared_gguf_readers = contextlib.nullcontext
    t0 = time.perf_counter()
    llm = LLM(path, attention_backend="torch", kv_dtype="float32", dtype="float32",
              device="cpu", num_pages=160, max_model_len=1200, max_num_batched_tokens=256,
              max_num_seqs=8, seed=3)
    load = time.perf_counter() - t0
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, llm.engine.vocab_size, (n,), generator=g).tolist()
               for n in (70, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    print(f"{path}: load {load:.1f} s ({'four parses' if args.no_share else 'one parse'}); "
          f"tokens {[list(o.outputs[0].token_ids) for o in outs]}")


if __name__ == "__main__":
    main()
