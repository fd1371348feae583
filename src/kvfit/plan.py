"""``kvfit plan``: KV capacity for a model and a memory size, every KV dtype side by side,
from the config alone (no weights loaded). Uses the same price list as the engine."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.hybrid_swa import solve_hybrid_pages
from kvfit.kvcache.spec import solve_num_pages, spec_kv_bytes_per_token
from kvfit.models import registry as models

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

PLAN_DTYPES = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


def parse_memory(text: str) -> int:
    """'2.9GiB', '2.90 GiB', '8GB', '1073741824' -> bytes (ValueError naming the format)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 2.9GiB, 8GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class PlanRow:
    kv_dtype: str
    bytes_per_token: int
    pages: int
    tokens: int
    pool_bytes: int
    ratio_vs_first: float
    max_concurrency: float
    swa_pages: int = 0  # hybrid sliding-window models: pages reserved for the windowed layers
    swa_bytes: int = 0
    window_requests: int = 0


def plan_capacity(model: str, memory_bytes: int, page_size: int = 16,
                  kv_dtypes: Sequence[str] = PLAN_DTYPES,
                  max_model_len: int | None = None, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 8192) -> tuple[object, list[PlanRow]]:
    """(hf_config, one row per KV dtype) for a KV budget of ``memory_bytes``."""
    src = models.resolve_model(model)
    cfg = models.load_hf_config(src)
    layers = models.model_class_for(cfg).kv_layer_specs(cfg)
    ctx = max_model_len or int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    rows: list[PlanRow] = []
    hybrid = any(l.kind == "sliding" for l in layers)
    for name in kv_dtypes:
        fmt = kv_format(name)
        if hybrid:  # full layers priced per token, windowed layers per running request
            hp = solve_hybrid_pages(memory_bytes, layers, fmt, page_size, max_num_seqs,
                                    max_num_batched_tokens)
            pages, bpt, tokens = hp.num_pages, hp.full_bytes_per_token, hp.full_tokens
            extra = (hp.num_swa_pages, hp.swa_bytes, hp.window_requests)
        else:
            pages = solve_num_pages(memory_bytes, layers, fmt, page_size)
            bpt = spec_kv_bytes_per_token(layers, fmt)
            tokens = pages * page_size
            extra = ()
        first = rows[0].tokens if rows else tokens
        rows.append(PlanRow(fmt.name, bpt, pages, tokens, tokens * bpt,
                            tokens / first if first else 0.0, tokens / ctx, *extra))
    return cfg, rows


def format_plan(model: str, memory_bytes: int, page_size: int, cfg, rows: list[PlanRow],
                max_model_len: int | None = None) -> str:
    ctx = max_model_len or int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    lines = [f"KV plan for {model} ({cfg.model_type}, {cfg.num_hidden_layers} layers) in "
             f"{memory_bytes / 2**30:.2f} GiB, pages of {page_size} tokens, context {ctx:,}",
             "",
             "| kv dtype | bytes/token | pages | tokens | pool GiB | vs first | max concurrency |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.kv_dtype} | {r.bytes_per_token:,} | {r.pages:,} | {r.tokens:,} | "
                     f"{r.pool_bytes / 2**30:.3f} | {r.ratio_vs_first:.2f}x | "
                     f"{r.max_concurrency:.2f} |")
    if any(r.swa_pages for r in rows):
        kinds = [l.kind for l in models.model_class_for(cfg).kv_layer_specs(cfg)]
        lines += ["", f"Sliding-window model: {kinds.count('full')} full layers hold the tokens "
                  f"above (bytes/token and pool GiB are theirs); {kinds.count('sliding')} "
                  f"windowed layers (window {cfg.sliding_window}) cost a reservation per running "
                  f"request, taken from the same memory:", "",
                  "| kv dtype | sliding pages | sliding GiB | requests at the window |",
                  "|---|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.kv_dtype} | {r.swa_pages:,} | {r.swa_bytes / 2**30:.3f} | "
                         f"{r.window_requests:,} |")
    return "\n".join(lines)
