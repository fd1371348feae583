"""The cheap start-up checks around ``resolve_settings``, run before the tokenizer and the weights.

``check_runs_here(config)`` needs no model (device present, named backend runs on it);
``resolve_settings`` (engine/settings.py) then reads and checks the model input
(models/validate.py) and runs the guard; ``check_memory(settings)`` compares the weight bytes with
available RAM / free GPU memory and warns about a busy CPU. Nothing here mutates state or
allocates a weight: the bytes come from the model class built on the ``meta`` device. Every
failure raises one of the user-facing errors in ``kvfit.errors`` (the CLI prints it as one
``kvfit: error:`` line).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvfit.attention.registry import BACKENDS, unavailable_reason
from kvfit.config import EngineConfig
from kvfit.engine import memory
from kvfit.engine.settings import EngineSettings
from kvfit.errors import KVBudgetError, UnsupportedCombinationError

log = logging.getLogger("kvfit")
GiB = 1 << 30


@dataclass(frozen=True)
class WeightEstimate:
    """Bytes the weights take: ``resident`` in the compute dtype, ``peak`` while loading (the
    model is built in torch's default dtype, float32, then cast)."""

    num_params: int
    resident: int
    peak: int


def estimate_weights(model_cls, hf_config, max_model_len: int, dtype: torch.dtype
                     ) -> WeightEstimate:
    """Weight bytes of ``model_cls(hf_config)`` without allocating them (built on ``meta``)."""
    with torch.device("meta"):
        model = model_cls(hf_config, max_model_len)
    n = sum(p.numel() for p in model.parameters())
    build = torch.get_default_dtype().itemsize
    return WeightEstimate(n, n * dtype.itemsize, n * max(build, dtype.itemsize))


def check_weights_fit(est: WeightEstimate, device: torch.device, memory_ratio: float,
                      source: str) -> None:
    """Refuse (KVBudgetError naming both numbers) weights that cannot fit: on CUDA in
    ``memory_ratio`` x free GPU memory, on CPU in the available RAM; warn above half of it."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        allowed, where = int(free * memory_ratio), (f"{memory_ratio:.2f} x {free / GiB:.2f} GiB "
                                                     f"free GPU memory")
        fix = "raise --memory-ratio, free the GPU, or use a smaller model"
    else:
        allowed, where = memory.cpu_available_bytes(), "available RAM (MemAvailable)"
        fix = "free memory, use a smaller model, or check the config's sizes"
    if est.peak > allowed:
        raise KVBudgetError(
            f"the weights of {source} do not fit: {est.num_params / 1e9:.2f} B parameters need "
            f"{est.peak / GiB:.2f} GiB while loading ({est.resident / GiB:.2f} GiB resident), "
            f"but only {allowed / GiB:.2f} GiB is available ({where}); {fix}")
    if est.peak > allowed // 2:
        log.warning("the weights of %s take %.2f GiB while loading, more than half of the "
                    "%.2f GiB available (%s); if this is not the model's size, check its config",
                    source, est.peak / GiB, allowed / GiB, where)


def warn_busy_cpu() -> None:
    """On a CPU whose load exceeds its cores, torch's one-thread-per-core default oversubscribes
    them (decode measured 23x slower on a loaded 2-core machine): say how to avoid it."""
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() < 2:
        return
    try:
        load = os.getloadavg()[0]
    except OSError:
        return
    cores = os.cpu_count() or 1
    if load > cores:
        log.warning("the CPU is busy (load average %.1f on %d cores) and torch uses %d threads; "
                    "if generation is slow, run with OMP_NUM_THREADS=1", load, cores,
                    torch.get_num_threads())


def check_runs_here(config: EngineConfig) -> None:
    """Checks that need not read the model: the device exists and a named attention backend can
    run on it (raises UnsupportedCombinationError naming the backends that can)."""
    try:
        device = config.resolved_device
    except ValueError as e:  # --device cuda without a GPU
        raise UnsupportedCombinationError(str(e)) from None
    if config.attention_backend != "auto":
        why = unavailable_reason(config.attention_backend, device.type)
        if why:
            here = [b for b in BACKENDS if unavailable_reason(b, device.type) is None]
            raise UnsupportedCombinationError(
                f"unsupported combination (backend={config.attention_backend}, "
                f"device={device.type}): {why}; these backends run here: {', '.join(here)} "
                f"(--attention-backend)")


def check_memory(settings: EngineSettings) -> None:
    """After the settings are resolved (inputs checked, guard run), before the tokenizer and the
    weights: refuse weights that cannot fit, warn about a busy CPU, say what will load."""
    from kvfit.parallel.state import rank0_shapes

    with rank0_shapes(settings.tp_size):  # tensor parallel: one rank's shard per device
        est = estimate_weights(settings.model_cls, settings.hf_config, settings.max_model_len,
                               settings.dtype)
    check_weights_fit(est, settings.device, settings.config.memory_ratio, settings.source.path)
    if settings.device.type == "cpu":
        warn_busy_cpu()
    per = f" per rank, {settings.tp_size} ranks" if settings.tp_size > 1 else ""
    log.info("loading %s: %s, %.2f B parameters (%.2f GiB of %s weights%s), %s KV on %s",
             settings.config.model, settings.hf_config.model_type, est.num_params / 1e9,
             est.resident / GiB, str(settings.dtype).replace("torch.", ""), per,
             settings.kv_format.name, settings.device.type)
