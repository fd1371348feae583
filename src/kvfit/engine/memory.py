"""The KV memory budget: how many bytes the pool may take (the pages that buys are decided by the
pool, ``kvcache/sizing.py``).

CUDA: ``memory_ratio`` of the memory free before the weights were loaded, minus what the weights
and the peak activations of one full step took (both measured), as mini-sglang/FreeToken do.
CPU: ``min(cpu_kv_space_gib, memory_ratio * MemAvailable after loading the weights)``
(vLLM's CPU backend likewise reserves a fixed KV space, default 4 GiB).
``--num-pages`` / ``--num-tokens`` override both.
"""

from __future__ import annotations

from kvfit.errors import KVBudgetError

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
