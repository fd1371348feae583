"""``kvfit bench quality``: what a KV format costs in answers, on a real model.

Each KV format (a ``--kv-dtypes`` entry; the first is the baseline, ``auto`` = the compute dtype,
float32 on CPU) gets one row:
  bytes per element and KV tokens at a fixed budget (``--budget``, the engine's own sizing),
  (a) passkey retrieval at 10/50/90% depth of a long filler context (k keys per depth),
  (b) greedy agreement with the baseline on 12 short chat prompts (identical count, first
      divergence position),
  (c) mean and max next-token KL divergence vs the baseline over the shipped text, top-1
      agreement of those next-token distributions, and perplexity.
An entry may carry options after a colon, comma-separated: ``int8:nocenter`` (K centering off), ``fp8_e4m3:center`` (on),
``fp8_e4m3:cal=PATH`` (K means from a ``--kv-calibration`` file), ``fp8_e4m3:auto-scales``.
The compute dtype is the engine's: only the KV storage changes between rows. A progress line
follows each stage. Quick on a CPU (minutes): --context 1024 --keys 1 --agree-tokens 16
--kl-tokens 512.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Optional

import torch

from kvfit.bench.progress import Stage, StageClock
from kvfit.plan import parse_memory

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"

PROMPTS = [
    "What is the capital of Japan?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
    "What is 15 plus 27?",
    "Translate 'good morning' into Spanish.",
    "Give one tip for sleeping better.",
    "What does a CPU do, in one sentence?",
    "List the first five prime numbers.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "Explain what a linked list is in two sentences.",
    "Who wrote 'Romeo and Juliet'?",
]


def quality_text() -> str:
    return resources.files("kvfit.bench").joinpath("data/quality_text.txt").read_text()


def chat_prompts(tok) -> list[list[int]]:
    """The 12 prompts through the chat template when there is one, as token ids."""
    out = []
    for p in PROMPTS:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
            out.append(tok(text, add_special_tokens=False)["input_ids"])
        else:
            out.append(tok(p)["input_ids"])
    return out


def passkey_prompt(tok, context: int, depth: float, key: int) -> list[int]:
    """~``context`` tokens of filler with the needle at ``depth``, ending with the question."""
    filler_ids = tok(FILLER, add_special_tokens=False)["input_ids"]
    needle = tok(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    bos = tok("", add_special_tokens=True)["input_ids"]
    room = context - len(needle) - len(question) - len(bos)
    reps = max(1, room // len(filler_ids))
    at = round(reps * depth)
    body = filler_ids * at + needle + filler_ids * (reps - at)
    return bos + body + question


def sequence_logprobs(engine, token_ids: list[int], chunk: int):
    """Yield log-softmax rows [n, V] for every position of ``token_ids`` (chunked prefill through
    the engine's runner; pages come from the engine's scheduler and go back at the end, so no
    other request may be running)."""
    from kvfit.sampling_params import SamplingParams
    from kvfit.scheduler.request import Request

    runner, sched = engine.runner, engine.scheduler
    if len(token_ids) > runner.max_model_len:
        raise ValueError(f"text of {len(token_ids)} tokens is longer than max_model_len "
                         f"{runner.max_model_len}")
    req = Request("kl", None, token_ids, SamplingParams(temperature=0, max_tokens=1), None, 0)
    try:
        while req.num_computed_tokens < len(token_ids):
            n = min(chunk, len(token_ids) - req.num_computed_tokens)
            if not sched.grow(req, req.num_computed_tokens + n):
                raise ValueError(f"the KV pool cannot hold {len(token_ids)} tokens")
            res = runner.execute([(req, n)], [False], [True])
            req.num_computed_tokens += n
            yield res.prompt_rows[0][1]
    finally:
        sched.release(req)


@dataclass
class Row:
    name: str
    needle: dict = field(default_factory=dict)  # depth -> [hits, total]
    identical: int = 0
    first_divergence: list = field(default_factory=list)
    kl_mean: float = 0.0
    kl_max: float = 0.0
    ppl: float = 0.0
    top1: float = 0.0
    bytes_per_elem: float = 0.0
    budget_tokens: int = 0
    seconds: float = 0.0


# first guesses (seconds per unit on a 2-core CPU, SmolLM2) until a stage of the kind has run
_PRIOR = {"load": 20.0, "prefill": 1 / 300, "decode": 1 / 60}


def plan_stages(args, labels: list[str]) -> list[Stage]:
    """Every stage of the run in order, sized in tokens (a load is one unit)."""
    stages = []
    for label in labels:
        stages.append(Stage(f"{label}: load", "load", 1))
        for d in args.depths:
            stages.append(Stage(f"{label}: passkey @{int(d * 100)}%", "prefill",
                                args.keys * args.context))
        if not args.needle_only:
            stages.append(Stage(f"{label}: agreement", "decode", len(PROMPTS) * args.agree_tokens))
            stages.append(Stage(f"{label}: KL + perplexity", "prefill", args.kl_tokens))
    return stages


def parse_variant(entry: str) -> tuple[str, dict]:
    """``int8:nocenter,cal=F.json`` -> ("int8", engine kwargs); ValueError naming bad options."""
    name, _, opts = entry.partition(":")
    kw: dict = {}
    for opt in filter(None, opts.split(",")):
        if opt == "nocenter":
            kw["kv_k_centering"] = "off"
        elif opt == "center":
            kw["kv_k_centering"] = "on"
        elif opt.startswith("cal="):
            kw["kv_calibration"] = opt[4:]
        elif opt == "auto-scales":
            kw["kv_scales"] = "auto"
        else:
            raise ValueError(f"unknown option {opt!r} in {entry!r}; known: nocenter, center, "
                             "cal=PATH, auto-scales")
    return name, kw


def budget_capacity(engine, budget: int) -> tuple[float, int]:
    """(KV bytes per element, tokens the engine's pool holds in ``budget`` bytes) for the
    engine's model and KV format: the price list and the pool's own sizing."""
    from kvfit.kvcache.sizing import SizingLimits
    from kvfit.kvcache.spec import spec_kv_bytes_per_token

    s = engine.runner.settings
    per_token = spec_kv_bytes_per_token(s.layers, s.kv_format)
    elems = sum(l.elems_per_token for l in s.layers)
    lim = SizingLimits(budget, None, None, s.config.max_num_seqs, s.config.max_num_batched_tokens,
                       s.dtype)  # the compute dtype prices int4's full-precision residual
    return per_token / elems, s.pool_cls.solve_pages(s.layers, s.kv_format, s.page_size, lim).tokens


def run(args) -> tuple[list[Row], dict]:
    from kvfit import LLM, SamplingParams

    variants = []
    for entry in args.kv_dtypes:
        name, kw = parse_variant(entry)
        variants.append((entry, name, kw))
        if args.auto_scales is not None and name.startswith("fp8") and (
                not args.auto_scales or name in args.auto_scales):
            variants.append((f"{entry} + auto scales", name, {**kw, "kv_scales": "auto"}))
    clock = StageClock(plan_stages(args, [v[0] for v in variants]), _PRIOR)
    print(f"kvfit bench quality: {len(variants)} KV formats x ({len(args.depths)} depths x "
          f"{args.keys} passkeys of ~{args.context:,} tokens"
          + ("" if args.needle_only else f", {len(PROMPTS)} prompts x {args.agree_tokens} greedy "
             f"tokens, KL over {args.kl_tokens:,} tokens") + f"); first guess: "
          f"{clock.estimate_line()} (refined after each stage)", flush=True)
    rng = random.Random(args.seed)
    keys = {d: [rng.randint(10000, 99999) for _ in range(args.keys)] for d in args.depths}
    base_tokens: Optional[list[list[int]]] = None
    base_lp: Optional[list[torch.Tensor]] = None
    rows = []
    meta: dict = {}
    for label, kv, kw in variants:
        t0 = time.time()
        llm = LLM(args.model, kv_dtype=kv, device=args.device,
                  num_tokens=args.context * len(args.depths) * args.keys + 4096,
                  max_model_len=max(args.context + 64, args.kl_tokens + 1),
                  max_num_batched_tokens=args.chunk,
                  max_num_seqs=64, **kw)
        shown = f"auto ({llm.engine.runner.kv_format.name})" if label == "auto" else label
        tok = llm.get_tokenizer()
        clock.done(f"{label}: load")
        row = Row(shown)
        row.bytes_per_elem, row.budget_tokens = budget_capacity(llm.engine, args.budget)
        # (a) passkey, one depth at a time (a progress line each)
        for d in args.depths:
            prompts = [{"prompt_token_ids": passkey_prompt(tok, args.context, d, k)}
                       for k in keys[d]]
            meta["context_tokens"] = len(prompts[0]["prompt_token_ids"])
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                use_tqdm=False)
            hits = sum(str(k) in o.outputs[0].text for k, o in zip(keys[d], outs))
            row.needle[str(d)] = [hits, len(keys[d])]
            clock.done(f"{label}: passkey @{int(d * 100)}%", f"{hits}/{len(keys[d])} found")
        if args.needle_only:
            row.identical = -1  # not measured
            rows.append(row)
            row.seconds = time.time() - t0
            print(f"[{label}] done in {row.seconds:.0f} s: {format_row(row, args.depths)}",
                  flush=True)
            del llm
            continue
        # (b) greedy agreement
        outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts(tok)],
                            SamplingParams(temperature=0, max_tokens=args.agree_tokens),
                            use_tqdm=False)
        toks = [o.outputs[0].token_ids for o in outs]
        clock.done(f"{label}: agreement")
        if base_tokens is None:
            base_tokens = toks
        for a, b in zip(toks, base_tokens):
            if a == b:
                row.identical += 1
            else:
                row.first_divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                 min(len(a), len(b))))
        # (c) KL vs the first row, and perplexity
        ids = tok(quality_text())["input_ids"][: args.kl_tokens]
        meta["kl_tokens"] = len(ids)
        kls, nll, top1 = [], [], []
        lps = []
        pos = 0
        for lp in sequence_logprobs(llm.engine, ids, args.chunk):
            n = lp.shape[0]
            tgt = torch.tensor(ids[pos + 1: pos + n + 1])
            nll.append(-lp[torch.arange(len(tgt)), tgt])
            if base_lp is None:
                lps.append(lp)
            else:
                ref = base_lp[len(kls)]
                kls.append((ref.exp() * (ref - lp)).sum(-1))  # KL(base || this) per position
                top1.append((ref.argmax(-1) == lp.argmax(-1)).float())
            pos += n
        if base_lp is None:
            base_lp = lps
            kls = [torch.zeros(1)]
        kl = torch.cat(kls)
        row.kl_mean, row.kl_max = float(kl.mean()), float(kl.max())
        row.top1 = float(torch.cat(top1).mean()) if top1 else 1.0
        row.ppl = float(torch.cat(nll).mean().exp())
        clock.done(f"{label}: KL + perplexity")
        row.seconds = time.time() - t0
        rows.append(row)
        print(f"[{label}] done in {row.seconds:.0f} s: {format_row(row, args.depths)}", flush=True)
        del llm
    return rows, meta


def format_row(r: Row, depths) -> str:
    needle = " | ".join(f"{r.needle[str(d)][0]}/{r.needle[str(d)][1]}" for d in depths)
    cap = f"{r.bytes_per_elem:.3f} | {r.budget_tokens:,}"
    if r.identical < 0:  # needle only
        return f"| {r.name} | {cap} | {needle} | - | - | - | - | - | - |"
    div = (f"{min(r.first_divergence)} / {statistics.median(r.first_divergence):.0f}"
           if r.first_divergence else "-")
    return (f"| {r.name} | {cap} | {needle} | {r.identical}/{len(PROMPTS)} | {div} | "
            f"{r.kl_mean:.5f} | {r.kl_max:.3f} | {r.top1:.4f} | {r.ppl:.3f} |")


def table(rows, args, meta) -> str:
    hdr = " | ".join(f"needle @{int(d * 100)}%" for d in args.depths)
    lines = [f"model {args.model}, compute float32 on {args.device}; passkey context "
             f"{meta.get('context_tokens')} tokens, {args.keys} keys per depth; agreement "
             f"{len(PROMPTS)} chat prompts x {args.agree_tokens} greedy tokens vs the first row; "
             f"KL and top-1 vs the first row over {meta.get('kl_tokens')} tokens of the shipped "
             f"text; KV tokens in {args.budget / 2**30:.2f} GiB", "",
             f"| KV format | bytes/elem | KV tokens | {hdr} | identical | first divergence "
             f"min / median | mean KL | max KL | top-1 | perplexity |",
             "|---|" + "---:|" * (len(args.depths) + 8)]
    lines += [format_row(r, args.depths) for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvfit bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-dtypes", nargs="+",
                   default=["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"],
                   help="KV formats, each optionally with :nocenter, :center, :cal=PATH, :auto-scales; "
                        "the first is the baseline for agreement, KL and top-1 (auto = the "
                        "compute dtype, float32 on CPU)")
    p.add_argument("--budget", type=parse_memory, default=2**30,
                   help="KV bytes for the 'KV tokens' column (e.g. 1GiB)")
    p.add_argument("--auto-scales", nargs="*", default=None, metavar="DTYPE",
                   help="also run these fp8 dtypes (all fp8 ones if none named) with "
                        "--kv-scales auto")
    p.add_argument("--context", type=int, default=2048, help="passkey context in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--keys", type=int, default=3, help="passkeys per depth")
    p.add_argument("--agree-tokens", type=int, default=48)
    p.add_argument("--kl-tokens", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens per step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle-only", action="store_true", help="skip agreement and KL")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    args = p.parse_args(argv)
    rows, meta = run(args)
    out = table(rows, args, meta)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "meta": meta, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)
    return 0
