"""The KV memory budget: how many bytes the pool may take, and the start-up capacity line.

CUDA: ``memory_ratio`` of the memory free before the weights were loaded, minus what the weights
and the peak activations of one full step took (both measured), as mini-sglang/FreeToken do.
CPU: ``min(cpu_kv_space_gib, memory_ratio * MemAvailable after loading the weights)``
(vLLM's CPU backend likewise reserves a fixed KV space, default 4 GiB).
``--num-pages`` / ``--num-tokens`` override both.
"""

from __future__ import annotations

from typing import Sequence

from kvfit.errors import KVBudgetError
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.spec import KVLayerSpec, solve_num_pages, spec_kv_bytes_per_token

GiB = 1 << 30


def cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def cuda_budget_bytes(free_before: int, used_since: int, ratio: float) -> int:
    """ratio * free-before-weights minus weights+activations measured since then."""
    budget = int(free_before * ratio) - used_since
    if budget <= 0:
        raise KVBudgetError(
            f"not enough GPU memory for a KV cache: {ratio:.2f} x {free_before / GiB:.2f} GiB free "
            f"= {ratio * free_before / GiB:.2f} GiB allowed, but weights and activations took "
            f"{used_since / GiB:.2f} GiB; raise --memory-ratio, lower --max-num-batched-tokens, "
            f"or use a smaller model")
    return budget


def cpu_budget_bytes(space_gib: float, ratio: float) -> int:
    return int(min(space_gib * GiB, ratio * cpu_available_bytes()))


def decide_num_pages(layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                     budget_bytes: int | None, num_pages: int | None,
                     num_tokens: int | None) -> int:
    """Pages from the override flags if given, else from the byte budget."""
    if num_pages is not None:
        return num_pages
    if num_tokens is not None:
        return -(-num_tokens // page_size)
    assert budget_bytes is not None  # internal: the runner always passes one of the three
    pages = solve_num_pages(budget_bytes, layers, fmt, page_size)
    if pages < 1:
        raise KVBudgetError(
            f"the KV budget of {budget_bytes / GiB:.3f} GiB holds no page of {page_size} tokens "
            f"({spec_kv_bytes_per_token(layers, fmt) * page_size} bytes); raise --memory-ratio "
            f"or set --num-pages")
    return pages


def capacity_line(num_pages: int, page_size: int, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                  max_model_len: int) -> str:
    tokens = num_pages * page_size
    nbytes = tokens * spec_kv_bytes_per_token(layers, fmt)
    conc = tokens / max(1, max_model_len)
    return (f"KV cache: {tokens:,} tokens ({num_pages:,} pages x {page_size}), "
            f"{nbytes / GiB:.2f} GiB, {fmt.name}, {spec_kv_bytes_per_token(layers, fmt):,} B/token; "
            f"max concurrency at {max_model_len:,} tokens/request: {conc:.2f}x")
