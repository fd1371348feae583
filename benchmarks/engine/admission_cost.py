"""Host cost of admitting and scheduling a request whose 4k prefix is cached (the cached-prefix
probe's host path before its step launches), on any machine (CPU: a tiny Qwen3-shaped model,
random weights; the costs measured are the engine's Python, not the model's).

    PYTHONPATH=src python3 benchmarks/engine/admission_cost.py [--repeats 30]

Prints the medians of ``add_request`` and of the first ``schedule`` of each cached probe.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    args = p.parse_args()

    from kvfit.config import make_config
    from kvfit.engine.llm_engine import LLMEngine
    from kvfit.sampling_params import SamplingParams

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "src", "kvfit", "bench", "configs",
                           "qwen3-1.7b.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    eng = LLMEngine(make_config(model=path, load_format="dummy", kv_dtype="fp8_e4m3",
                                page_size=32, max_num_seqs=64, num_pages=2000))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    scheds: list[float] = []
    schedule = eng.scheduler.schedule

    def timed(*a, **k):
        t = time.perf_counter()
        out = schedule(*a, **k)
        scheds.append(time.perf_counter() - t)
        return out

    eng.scheduler.schedule = timed

    def rand(n):
        return [rng.randrange(1000, 100000) for _ in range(n)]

    rows = []
    for i in range(args.repeats + 2):
        prefix = rand(args.prefix_len)
        eng.add_request(f"u{i}", prefix + rand(args.suffix_len), sp)
        while eng.has_unfinished_requests():
            eng.step()
        prompt = prefix + rand(args.suffix_len)
        scheds.clear()
        t = time.perf_counter()
        eng.add_request(f"c{i}", prompt, sp)
        add = time.perf_counter() - t
        eng.step()
        rows.append((add, scheds[0]))
        while eng.has_unfinished_requests():
            eng.step()
    rows = rows[2:]
    print(f"cached {args.prefix_len}+{args.suffix_len}-token probe, medians of {len(rows)}: "
          f"add_request {1e3 * statistics.median(a for a, _ in rows):.3f} ms, schedule "
          f"{1e3 * statistics.median(s for _, s in rows):.3f} ms")


if __name__ == "__main__":
    main()
