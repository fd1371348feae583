"""Host costs per engine step that grow with the running requests (CPU, no model run):

1. incremental detokenization per token and request: ``DecodeStream`` (fast tokenizers) against
   the windowed decode, on the bundled SmolLM2 tokenizer, over 400 tokens of text;
2. building the step's outputs for 256 running requests with 600 output tokens each, one new
   token per step: cumulative outputs (a copy of the output so far) against deltas.

Usage: PYTHONPATH=src python3 benchmarks/engine/host_costs.py
"""

from __future__ import annotations

import time
import types

from kvfit.config import make_config
from kvfit.engine.detokenizer import IncrementalDetokenizer
from kvfit.engine.llm_engine import LLMEngine
from kvfit.engine.settings import resolve_settings
from kvfit.models.registry import load_tokenizer
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import Request


def detok_us(tok, ids) -> float:
    d = IncrementalDetokenizer(tok)
    t = time.perf_counter()
    for n in range(1, len(ids) + 1):
        d.update(ids, final=n == len(ids), n=n)
    return (time.perf_counter() - t) / len(ids) * 1e6


def outputs_ms(delta: bool, reqs) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            for r in reqs:
                r.num_output_emitted = len(r.output_token_ids) - 1  # one new token a step
                LLMEngine._output(r, delta)
        best = min(best, (time.perf_counter() - t) / 50 * 1e3)
    return best


def main() -> None:
    tok = load_tokenizer(resolve_settings(make_config(model="smollm2-135m", device="cpu")).source,
                         None)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"][:400]
    print(f"detokenize, us per token update: DecodeStream {detok_us(tok, ids):.2f}, "
          f"windowed {detok_us(types.SimpleNamespace(decode=tok.decode), ids):.2f}")
    reqs = []
    for i in range(256):
        r = Request(f"r{i}", None, list(range(500)), SamplingParams(max_tokens=2000), 0, i)
        r.output_token_ids = list(range(600))
        reqs.append(r)
    print(f"outputs of 256 requests x 600 tokens, ms per step: cumulative "
          f"{outputs_ms(False, reqs):.2f}, delta {outputs_ms(True, reqs):.2f}")


if __name__ == "__main__":
    main()
