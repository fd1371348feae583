"""Cost of structured output: offline throughput of a batch where half the requests follow a JSON
schema, against the same batch with none (bundled SmolLM2-135M unless --model).

Output lengths are fixed on both sides: plain requests use ``ignore_eos``, and the schema (an
integer array of at least ``--output-len`` items) cannot end before ``max_tokens``, so both runs
generate exactly ``batch x output_len`` tokens. Also reports the host time of the grammar work
(bitmask fill + token accept) per step and the first compile of the schema.

    OMP_NUM_THREADS=1 python3 benchmarks/engine/structured_cost.py --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvfit import LLM, SamplingParams
from kvfit.structured_params import StructuredOutputsParams


class _Timed:
    """Wraps one method of ``obj`` and sums its wall time."""

    def __init__(self, obj, name: str):
        self.total, self.calls, fn = 0.0, 0, getattr(obj, name)

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1

        setattr(obj, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch, max_model_len=512)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": args.output_len}
    spec = StructuredOutputsParams(json=schema, strict=True)
    prompts = [f"List {args.output_len} numbers, one of them {i}, as a JSON array:"
               for i in range(args.batch)]
    plain = SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len, ignore_eos=True)
    structured = SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len,
                                structured_outputs=spec)
    half = [structured if i % 2 else plain for i in range(args.batch)]

    eng = llm.engine
    t = time.perf_counter()
    grammar = eng._structured_outputs()  # xgrammar's tokenizer info and compiler, once
    build = time.perf_counter() - t
    t = time.perf_counter()
    grammar.compiled(spec)  # the first request with this schema compiles it (then cached)
    compile_s = time.perf_counter() - t
    fill, accept = _Timed(eng._structured, "fill_bitmask"), _Timed(eng._structured, "accept")
    llm.generate(prompts, plain, use_tqdm=False)  # warm-up

    rows: dict[str, list[float]] = {"none": [], "half": []}
    host = []
    for _ in range(args.repeats):
        for name, params in (("none", plain), ("half", half)):
            f0, a0, n0 = fill.total, accept.total, fill.calls
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n_tok == args.batch * args.output_len, n_tok
            rows[name].append(n_tok / dt)
            if name == "half":
                host.append(((fill.total - f0) + (accept.total - a0)) / max(fill.calls - n0, 1))
    none, halfs = statistics.median(rows["none"]), statistics.median(rows["half"])
    print(f"batch {args.batch}, output {args.output_len} tokens each, {args.repeats} repeats "
          f"(median), device {args.device}")
    print("| requests with a JSON schema | output tok/s | vs none |")
    print("|---|---:|---:|")
    print(f"| none | {none:.1f} | 1.00x |")
    print(f"| half ({args.batch // 2} of {args.batch}) | {halfs:.1f} | {halfs / none:.2f}x |")
    print(f"grammar host time per step (bitmask fill + accept, {args.batch // 2} rows): "
          f"{statistics.median(host) * 1e3:.2f} ms")
    print(f"once per engine: xgrammar tokenizer info + compiler {build * 1e3:.0f} ms; once per "
          f"schema: compile {compile_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
