"""KL-only comparison of KV formats and K-centering / calibration-text variants on one model
(issue 14; docs/benchmarks.md, "int8 KV and K centering").

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/kv/kl_ablation.py MODEL [VARIANT ...]
        [--tokens 1024] [--out DIR] [--no-calibration-texts]

Reference: the float32 cache (``auto`` on CPU) over the first ``--tokens`` tokens of the shipped
quality text. Writes K-mean files calibrated on other texts (prose: the second half of the
shipped text, 1,400 tokens; code: kvfit's own scheduler source, 200 tokens) and adds int8 rows
that load them (``:cal=FILE``). Variants use ``kvfit bench quality``'s syntax (``int8:nocenter``).
Prints one ``RESULT`` line per variant and writes ``DIR/kl-MODEL-TOKENS.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvfit import LLM
from kvfit.bench.quality import parse_variant, quality_text, sequence_logprobs
from kvfit.engine.kv_calibration import calibrate_k_mean, save_calibration

DEFAULT = ["int8", "fp8_e4m3", "fp8_e4m3:center", "int8:nocenter"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("variants", nargs="*", default=DEFAULT)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--out", default="kl_ablation_out")
    p.add_argument("--no-calibration-texts", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    kw = dict(device="cpu", num_tokens=4096, max_model_len=2048, max_num_batched_tokens=512)
    llm = LLM(a.model, **kw)
    tok = llm.get_tokenizer()
    qt = quality_text()
    here = os.path.dirname(os.path.abspath(__file__))
    code = open(os.path.join(here, "../../src/kvfit/scheduler/scheduler.py")).read()
    variants = list(a.variants)
    if not a.no_calibration_texts:
        for name, text, cap in (("prose-long", qt[8000:], 1400), ("code-short", code, 200)):
            ids = tok(text)["input_ids"][:cap]
            path = os.path.join(a.out, f"kmean-{a.model}-{name}.json")
            save_calibration(path, calibrate_k_mean(llm.engine.runner, ids),
                             {"model": a.model, "tokens": len(ids), "text": name})
            variants.append(f"int8:cal={path}")
    ids = tok(qt)["input_ids"][: a.tokens]
    base = torch.cat(list(sequence_logprobs(llm.engine, ids, 512)))
    del llm
    out = {}
    for v in variants:
        t = time.time()
        kv, extra = parse_variant(v)
        llm = LLM(a.model, kv_dtype=kv, **kw, **extra)
        lp = torch.cat(list(sequence_logprobs(llm.engine, ids, 512)))
        kl = (base.exp() * (base - lp)).sum(-1)  # KL(float32 cache || variant) per position
        top1 = float((base.argmax(-1) == lp.argmax(-1)).float().mean())
        out[v] = {"kl_mean": float(kl.mean()), "top1": top1}
        print(f"RESULT {a.model} {v} KL {kl.mean():.5f} top1 {top1:.4f} "
              f"{time.time() - t:.0f}s", flush=True)
        del llm
    with open(os.path.join(a.out, f"kl-{a.model}-{a.tokens}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
