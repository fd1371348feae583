"""``kvfit bench seed``: the seed's table on a GPU, for any model or config shape, in one run.

Per KV dtype (bfloat16, fp8_e4m3, fp8_e5m2 by default) it builds the engine's ModelRunner with
``--load-format dummy`` and the engine flags given (``--attention-backend``, ``--page-size``,
``--memory-ratio``, ``--enforce-eager``, ..., generated from ``EngineConfig``) and reports:
- KV budget in tokens at a fixed byte budget (the seed's 2.90 GiB) and at the card's ratio
  (``memory_ratio`` x free memory - weights; activations not subtracted), through the engine's
  own page solver (the pool's ``solve_pages``, kvcache/sizing.py);
- decode throughput (tok/s) at batch 1 and 64 and ~1k and ~16k context: the pages of each request
  are filled with random KV (decode cost does not depend on the values), then timed decode steps
  run through the runner's CUDA graphs (or eager, with ``--enforce-eager``);
- prefill throughput of one 8k-token prompt;
- the batch-1 physical limit: (weight bytes + KV bytes read per step) / measured copy bandwidth,
  and the measured fraction of it;
- with ``--baseline hf``: HF transformers ``generate()`` on the same random-weight shape (decode
  tok/s at ~1k context, batch 1 and 64, prefill time subtracted).
Every step runs as the engine runs it (``ModelRunner.run_plan``, bench/seed_points.py), so
``--tensor-parallel-size N`` times the N-GPU group (rank 0 hands each step to the workers;
every rank's pool is filled; KV tokens and roofline are per GPU, the GPUs working in parallel).
Writes ``seed.md`` (markdown table), ``seed.json`` and ``seed.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvfit.bench.configs import config_path
from kvfit.bench.weight_reads import bytes_read, weight_reads
from kvfit.config import add_engine_args, config_from_args

GiB = 1 << 30
DEFAULT_CONFIG = config_path("qwen3-1.7b")
# EngineConfig fields the bench sets itself per KV dtype and point, or (model) defaults
# differently; every other engine flag comes from EngineConfig as in `kvfit generate`
BENCH_SETS = ("model", "kv_dtype", "device", "load_format", "tokenizer", "num_pages", "num_tokens",
              "max_model_len", "max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_bs",
              "cpu_kv_space_gib")


def parser() -> argparse.ArgumentParser:
    """The ``kvfit bench seed`` flags: the bench's own, then EngineConfig's engine flags."""
    p = argparse.ArgumentParser(prog="kvfit bench seed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG,
                   help="config.json (random weights) or model directory (default: the shipped "
                        "Qwen3-1.7B config, kvfit/bench/configs/qwen3-1.7b.json)")
    p.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3,fp8_e5m2",
                   help="comma-separated KV dtypes, one engine (and one table column) each")
    p.add_argument("--contexts", default="1024,16384")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--budget-gib", type=float, default=2.90)
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--out", default="bench-out/seed")
    add_engine_args(p, skip=BENCH_SETS)
    return p


def engine_config(args: argparse.Namespace, kv_dtype: str, num_tokens: int, max_model_len: int,
                  max_batch: int):
    """The EngineConfig of one KV dtype's runner: the engine flags given, random weights on
    CUDA, a pool of ``num_tokens`` and graphs up to ``max_batch`` requests."""
    return config_from_args(args, load_format="dummy", kv_dtype=kv_dtype, device="cuda",
                            num_tokens=num_tokens, max_model_len=max_model_len,
                            max_num_seqs=max_batch, cuda_graph_max_bs=max_batch,
                            max_num_batched_tokens=args.prefill_len)


def _sync():
    import torch

    torch.cuda.synchronize()


def hf_baseline(model_path: str, contexts, batches, steps: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvfit.models import registry as models

    cfg = models.load_hf_config(models.resolve_model(model_path))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    rows = []
    for ctx in contexts:
        for b in batches:
            ids = torch.randint(0, cfg.vocab_size, (b, ctx), device="cuda")

            def gen(n):
                _sync()
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)
                _sync()
                return time.perf_counter() - t0

            try:
                gen(2)
                t1, tn = gen(1), gen(steps + 1)
                rows.append({"batch": b, "context": ctx, "tok_s": b * steps / (tn - t1)})
            except torch.OutOfMemoryError:
                rows.append({"batch": b, "context": ctx, "tok_s": None, "note": "OOM"})
            torch.cuda.empty_cache()
    return rows


def _estimate_weight_bytes(c, tp_size: int = 1) -> int:
    """bf16 bytes of the model of config ``c`` on one GPU (rank 0's shard under tensor
    parallelism), to size the pool before loading: its class built on the meta device, else
    (no class) a Llama-family decoder's count."""
    import torch

    from kvfit.models import registry as models
    from kvfit.parallel.state import rank0_shapes

    try:
        with torch.device("meta"), rank0_shapes(tp_size):
            model = models.model_class_for(c)(c, 16)
        return 2 * sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - an estimate only; fall back to the Llama formula
        pass
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_layer = (c.hidden_size * hd * (c.num_attention_heads * 2 + kv * 2)
                 + 3 * c.hidden_size * c.intermediate_size)
    emb = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return 2 * (c.num_hidden_layers * per_layer + emb) // tp_size


def run_dtype(args, kvd: str, contexts, batches, bw: float, card_free: int) -> dict:
    """One KV dtype's column: build the runner (and, under ``--tensor-parallel-size N``, its
    workers: every figure is then the group's, the KV tokens those of each GPU's pool), fill
    every rank's pool, time the points, close the runner. ``card_free``: the card's free bytes
    before any runner, the base of every column's "KV tokens at ratio" (the pool built here is
    sized from what is free now, which an earlier column's CUDA context, graphs and kernels have
    lowered)."""
    import torch

    from kvfit.bench.seed_points import decode_point, fill_pool_of, prefill_point
    from kvfit.engine.runner import ModelRunner
    from kvfit.engine.settings import resolve_settings
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.sizing import SizingLimits
    from kvfit.kvcache.spec import spec_kv_bytes_per_token

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fmt = kv_format(kvd)
    tp = args.tensor_parallel_size
    ps = args.page_size or 32  # sizing only: the largest default page rounds up the most
    # size the pool for the largest point that fits the card's ratio
    max_ctx = max(contexts)
    need = max(b * (-(-(c + args.steps + 4) // ps)) * ps for b in batches for c in contexts)
    planned = resolve_settings(engine_config(args, kvd, need, max_ctx + args.steps + 8,
                                             max(batches)))
    layers = planned.layers  # one rank's: its share of the KV heads
    per_tok = spec_kv_bytes_per_token(layers, fmt)
    t0 = time.time()
    weight_bytes = _estimate_weight_bytes(planned.hf_config, tp)
    card_budget = int(free * args.memory_ratio) - weight_bytes - 2 * GiB  # 2 GiB activations
    fit_tokens = card_budget // per_tok
    tokens = min(need, fit_tokens)
    cfg = engine_config(args, kvd, tokens, max_ctx + args.steps + 8, max(batches))
    settings = resolve_settings(cfg)
    runner = ModelRunner(settings)
    try:
        ps = runner.pool.page_size

        def budget_tokens(budget: int) -> int:
            return settings.pool_cls.solve_pages(layers, fmt, ps, SizingLimits(budget)).tokens

        runner.collective_call(fill_pool_of)
        rec = {"kv_dtype": kvd, "tensor_parallel_size": tp, "kv_bytes_per_token": per_tok,
               "weight_bytes": runner.weight_bytes, "backend": runner.backend_name,
               "page_size": ps, "startup_s": time.time() - t0,
               "budget_tokens_fixed": budget_tokens(int(args.budget_gib * GiB)),
               "budget_tokens_card": budget_tokens(int(card_free * args.memory_ratio)
                                                   - runner.weight_bytes),
               "decode": [], "prefill_tok_s": None}
        cap = runner.pool.num_pages * ps
        reads = weight_reads(runner.model)
        for ctx in contexts:
            for b in batches:
                pt = {"batch": b, "context": ctx}
                if b * (-(-(ctx + args.steps + 4) // ps)) * ps > cap:
                    pt["note"] = (f"does not fit: needs {b * (ctx + args.steps) * per_tok / GiB:.1f}"
                                  f" GiB of KV per GPU, the card's budget holds {cap:,} tokens")
                else:
                    pt["tok_s"] = decode_point(runner, b, ctx, args.steps)
                    if b == 1:  # per GPU: the weights it reads (routed experts: those
                        # chosen; embeddings: a row) and its KV, read in parallel
                        step_bytes = bytes_read(reads, 1) + per_tok * ctx
                        pt["roofline_tok_s"] = bw / step_bytes
                        pt["pct_roofline"] = 100 * pt["tok_s"] / pt["roofline_tok_s"]
                rec["decode"].append(pt)
                print(f"  {kvd:>9} tp={tp} decode b={b:<3} ctx={ctx:<6} "
                      + (f"{pt['tok_s']:10.1f} tok/s" if "tok_s" in pt else pt["note"])
                      + (f"  ({pt['pct_roofline']:.0f}% of {pt['roofline_tok_s']:.0f} roofline)"
                         if "pct_roofline" in pt else ""), flush=True)
        if args.prefill_len <= cap:
            rec["prefill_tok_s"] = prefill_point(runner, args.prefill_len)
            print(f"  {kvd:>9} tp={tp} prefill {args.prefill_len}: "
                  f"{rec['prefill_tok_s']:.0f} tok/s", flush=True)
    finally:
        runner.close()  # tensor parallel: stop the workers, leave the group
    del runner
    torch.cuda.empty_cache()
    return rec


def table(res: dict) -> str:
    dts = [r["kv_dtype"] + (f", TP={r['tensor_parallel_size']}"
                            if r.get("tensor_parallel_size", 1) > 1 else "")
           for r in res["dtypes"]]
    lines = ["| metric | " + " | ".join(dts) + " |", "|---|" + "---|" * len(dts)]
    first = res["dtypes"][0]

    def row(name, vals):
        lines.append(f"| {name} | " + " | ".join(vals) + " |")

    row("attention backend, page size",
        [f"{r.get('backend', '-')}, {r.get('page_size', '-')}" for r in res["dtypes"]])
    row(f"KV tokens at {res['budget_gib']:.2f} GiB",
        [f"{r['budget_tokens_fixed']:,}" for r in res["dtypes"]])
    row(f"KV tokens at ratio {res['memory_ratio']} of {res['free_gib']:.0f} GiB free",
        [f"{r['budget_tokens_card']:,}" for r in res["dtypes"]])
    for i, pt in enumerate(first["decode"]):
        vals = []
        for r in res["dtypes"]:
            p = r["decode"][i]
            if "tok_s" not in p:
                vals.append("does not fit")
                continue
            s = f"{p['tok_s']:,.0f}"
            if "pct_roofline" in p:
                s += f" ({p['pct_roofline']:.0f}% of {p['roofline_tok_s']:,.0f})"
            vals.append(s)
        row(f"decode tok/s, batch {pt['batch']}, ctx {pt['context']}", vals)
    row(f"prefill tok/s, {res['prefill_len']} prompt",
        [f"{r['prefill_tok_s']:,.0f}" if r["prefill_tok_s"] else "-" for r in res["dtypes"]])
    for h in res.get("hf", []):
        lines.append(f"| HF generate() decode tok/s, batch {h['batch']}, ctx {h['context']} | "
                     + (f"{h['tok_s']:,.1f}" if h.get("tok_s") else h.get("note", "-"))
                     + " |" + " |" * (len(dts) - 1))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in res["dtypes"]:
        for b in sorted({p["batch"] for p in r["decode"]}):
            pts = [(p["context"], p["tok_s"]) for p in r["decode"]
                   if p["batch"] == b and "tok_s" in p]
            if pts:
                ax.plot(*zip(*pts), "-o", label=f"{r['kv_dtype']}, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s")
    backends = ", ".join(sorted({r.get("backend", res["backend"]) for r in res["dtypes"]}))
    ax.set_title(f"decode throughput, {os.path.basename(res['model'])}, {backends}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    """Entry point of ``kvfit bench seed``; returns the exit status."""
    args = parser().parse_args(argv)
    import torch

    from kvfit.bench.kernels_common import copy_bandwidth

    if not torch.cuda.is_available():
        print("kvfit bench seed needs a CUDA GPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    bw = copy_bandwidth(torch.device("cuda"))
    torch.cuda.empty_cache()  # the copy's buffers back to the card
    free, total = torch.cuda.mem_get_info()
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"{free / GiB:.0f} GiB free", flush=True)
    res = {"model": args.model, "backend": args.attention_backend, "gpu":
           torch.cuda.get_device_name(), "copy_bw": bw, "budget_gib": args.budget_gib,
           "memory_ratio": args.memory_ratio, "free_gib": free / GiB,
           "tensor_parallel_size": args.tensor_parallel_size,
           "prefill_len": args.prefill_len, "dtypes": []}
    for kvd in args.kv_dtypes.split(","):
        res["dtypes"].append(run_dtype(args, kvd, contexts, batches, bw, free))
    if args.baseline == "hf":
        res["hf"] = hf_baseline(args.model, [min(contexts)], batches, args.steps)
        for h in res["hf"]:
            print(f"  HF generate b={h['batch']} ctx={h['context']}: {h.get('tok_s')} tok/s")
    md = table(res)
    print(md)
    with open(os.path.join(args.out, "seed.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "seed.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(args.out, "seed.png"))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
