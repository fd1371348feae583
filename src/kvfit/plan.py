"""``kvfit plan``: KV capacity for a model and a memory size, every KV dtype side by side, from the
config alone (no weights loaded).

Each row resolves the engine's own settings (engine/settings.py: backend, page size, pool) for
the target device, ``cuda`` unless told otherwise, without needing that device here, and sizes
the pool with the pool's own ``solve_pages``: the tokens printed are the tokens the engine's
start-up line reports for the same KV budget.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

from kvfit.config import EngineConfig
from kvfit.engine.settings import EngineSettings, resolve_settings
from kvfit.kvcache.sizing import PoolSizing

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

PLAN_DTYPES = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def parse_memory(text: str) -> int:
    """'2.9GiB', '2.90 GiB', '8GB', '1073741824' -> bytes (ValueError naming the format)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 2.9GiB, 8GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class PlanRow:
    """One KV dtype: the settings the engine would resolve and the pool size they give."""

    settings: EngineSettings
    sizing: PoolSizing
    ratio_vs_first: float

    @property
    def kv_dtype(self) -> str:
        return self.settings.kv_format.name

    @property
    def max_concurrency(self) -> float:
        return self.sizing.tokens / self.settings.max_model_len

    def capacity_line(self) -> str:
        """The engine's start-up line for this row (same words, same numbers)."""
        s = self.settings
        return self.sizing.capacity_line(s.kv_format, min(s.max_model_len, self.sizing.tokens),
                                         s.tp_size, s.full_layers)


def plan_device(device: str) -> str:
    """The device type a plan is for: ``auto`` is what the engine would pick here."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_capacity(config: EngineConfig, memory_bytes: int,
                  kv_dtypes: Sequence[str] = PLAN_DTYPES, device: str = "cuda",
                  skip_unsupported: bool = False) -> list[PlanRow]:
    """One row per KV dtype for a KV budget of ``memory_bytes`` on ``device`` ("cuda" or "cpu").
    Under tensor parallelism (``config.tensor_parallel_size`` > 1) ``memory_bytes`` is each
    GPU's KV budget and the rows price one rank's pool (its share of the KV heads).

    ``config`` supplies the model and the other settings (backend, page size, model length,
    scheduler limits); its ``kv_dtype`` is replaced by each of ``kv_dtypes`` in turn.
    ``skip_unsupported``: leave out dtypes the guard refuses for this model (the default list
    on a model whose pool does not store int4) instead of raising.
    """
    from kvfit.errors import UnsupportedCombinationError
    from kvfit.models.gguf_readers import shared_gguf_readers

    rows: list[PlanRow] = []
    with shared_gguf_readers():  # one parse of a GGUF's metadata for every dtype
        for name in kv_dtypes:
            try:
                s = resolve_settings(dataclasses.replace(config, kv_dtype=name),
                                     plan_for=device)
            except UnsupportedCombinationError:
                if skip_unsupported:
                    continue
                raise
            sizing = s.pool_cls.solve_pages(s.layers, s.kv_format, s.page_size,
                                            s.sizing_limits(memory_bytes))
            first = rows[0].sizing.tokens if rows else sizing.tokens
            rows.append(PlanRow(s, sizing, sizing.tokens / first if first else 0.0))
    return rows


def format_plan(memory_bytes: int, rows: list[PlanRow]) -> str:
    """The markdown table ``kvfit plan`` prints, saying which backend and page size each row
    assumed and how they were chosen."""
    s0 = rows[0].settings
    cfg = s0.hf_config
    where = (f"in {memory_bytes / 2**30:.2f} GiB on {s0.device.type}" if s0.tp_size == 1 else
             f"in {memory_bytes / 2**30:.2f} GiB per GPU on {s0.tp_size} {s0.device.type} GPUs "
             f"(tensor parallel, {memory_bytes * s0.tp_size / 2**30:.2f} GiB in all)")
    lines = [f"KV plan for {s0.config.model} ({cfg.model_type}, {cfg.num_hidden_layers} layers) "
             f"{where}, context {s0.max_model_len:,}",
             "",
             "| kv dtype | backend | page size | bytes/token | pages | tokens | pool GiB "
             "| vs first | max concurrency |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        z = r.sizing
        lines.append(f"| {r.kv_dtype} | {r.settings.backend_name} | {z.page_size} | "
                     f"{z.bytes_per_token:,} | {z.num_pages:,} | {z.tokens:,} | "
                     f"{z.pool_bytes / 2**30:.3f} | {r.ratio_vs_first:.2f}x | "
                     f"{r.max_concurrency:.2f} |")
    if s0.tp_size > 1:
        kv = s0.full_layers[0].num_kv_heads
        stores = (f"the whole MLA latent (shared by all query heads, so the KV capacity per "
                  f"GPU does not grow with tensor parallelism)"
                  if s0.full_layers[0].kind == "mla" else
                  f"{s0.layers[0].num_kv_heads} of the {kv} KV heads")
        lines += ["", f"Tensor parallel over {s0.tp_size} GPUs: each GPU stores {stores} for "
                  f"every token, so bytes/token and pool GiB are per GPU and the tokens are the "
                  f"engine's (the same on every GPU); the pools of all GPUs take "
                  f"{s0.tp_size}x pool GiB. Per dtype, per GPU and in total:", ""]
        lines += [f"- {r.capacity_line()}" for r in rows]
    explicit = s0.config.max_model_len
    short = [r.kv_dtype for r in rows if explicit and r.sizing.tokens < explicit]
    if short:
        lines += ["", f"--max-model-len {explicit:,} does not fit the {', '.join(short)} KV "
                  f"cache: the engine refuses to start with it (lower it or raise --memory)."]
    if s0.backend_chosen == "auto":
        where = (" with FlashInfer and Triton installed (no CUDA device here)"
                 if s0.assumed_installed else " here")
        lines += ["", f"Backend and page size: the engine's auto choice on {s0.device.type}"
                  f"{where}; --attention-backend and --page-size plan another."]
    else:
        lines += ["", f"Backend {s0.backend_name} as requested; page size "
                  + ("as requested." if s0.config.page_size else "its default.")]
    for r in rows:
        res = getattr(r.sizing, "residual_bytes", None)
        if res:  # int4: the full-precision residual pages come off the same memory
            z = r.sizing
            lines += ["", f"{r.kv_dtype}: pool GiB includes the residual buffer, one "
                      f"{str(z.residual_dtype).replace('torch.', '')} page of {z.page_size} "
                      f"tokens per running request (--max-num-seqs {z.residual_slots}): "
                      f"{res / 2**30:.3f} GiB (lower --max-num-seqs for more tokens)."]
    hybrid = [(r, r.sizing.sliding_reservation) for r in rows
              if r.sizing.sliding_reservation is not None]
    if hybrid:
        h = hybrid[0][1]
        lines += ["", f"Sliding-window model: {h.num_full_layers} full layers hold the tokens "
                  f"above (bytes/token are theirs; pool GiB includes the reservation); "
                  f"{h.num_sliding_layers} windowed layers (window {h.window}) cost a "
                  f"reservation per running request, taken from the same memory:", "",
                  "| kv dtype | sliding pages | sliding GiB | requests at the window |",
                  "|---|---:|---:|---:|"]
        for r, z in hybrid:
            lines.append(f"| {r.kv_dtype} | {z.num_swa_pages:,} | {z.swa_bytes / 2**30:.3f} | "
                         f"{z.window_requests:,} |")
    return "\n".join(lines)
