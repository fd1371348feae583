"""The KV pool's size at start-up: the memory budget (``engine/memory.py``) from the measured
weights and peak activations, the pages it buys (the pool's ``solve_pages``), the same page
count on every tensor-parallel rank, and ``max_model_len`` lowered to the capacity.

Functions of a ``ModelRunner`` being built (``engine/runner.py``): they read its config,
model, layers and settings, and set ``runner.kv_budget_bytes`` and (when the context does not
fit) ``runner.max_model_len``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.engine import memory
from kvfit.engine.context import Context
from kvfit.errors import KVBudgetError
from kvfit.kvcache.sizing import PoolSizing
from kvfit.parallel.state import min_over_ranks, tp_group

log = logging.getLogger("kvfit")


def one_slot(pool):
    """A throwaway one-request pool's residual slots (int4: slot 0), None for other pools."""
    return None if pool.residual_slots is None else [0]


def size_pool(runner, free_before: int) -> PoolSizing:
    """The pool's size from the memory budget (or the page flags); lowers ``max_model_len``
    to the capacity when the model's context does not fit, refuses an explicit one."""
    c = runner.config
    if c.num_pages is not None or c.num_tokens is not None:
        budget = None
    elif runner.device.type == "cuda":
        peak = profile_activations(runner)
        used = runner.weight_bytes + peak
        budget = memory.cuda_budget_bytes(free_before, used, c.memory_ratio)
    else:
        budget = memory.cpu_budget_bytes(c.cpu_kv_space_gib, c.memory_ratio)
    runner.kv_budget_bytes = budget  # None when --num-pages/--num-tokens fix the pool
    sizing = runner.pool_cls.solve_pages(runner.layers, runner.kv_format, c.page_size,
                                         runner.settings.sizing_limits(budget))
    if tp_group().size > 1 and budget is not None:
        # the fewest pages any rank's budget holds, full and sliding: page ids valid on all
        swa = sizing.sliding_reservation
        counts = min_over_ranks([sizing.num_pages] + ([swa.num_swa_pages] if swa else []))
        sizing = dataclasses.replace(sizing, num_pages=counts[0], **(
            {"num_swa_pages": counts[1]} if swa else {}))
    capacity = sizing.tokens
    if runner.max_model_len > capacity:
        if c.max_model_len is not None:
            raise KVBudgetError(
                f"--max-model-len {c.max_model_len} does not fit the KV cache "
                f"({capacity} tokens of {runner.kv_format.name}); the largest that fits is "
                f"{capacity}: lower --max-model-len, raise --memory-ratio, or use "
                f"--kv-dtype fp8 to double the tokens")
        log.warning("model context %d > KV capacity %d tokens: max_model_len set to %d",
                    runner.max_model_len, capacity, capacity)
        runner.max_model_len = capacity
    return sizing


@torch.inference_mode()
def profile_activations(runner) -> int:
    """Peak bytes of one full step of max_num_batched_tokens (a throwaway one-request pool)."""
    n = min(runner.config.max_num_batched_tokens, runner.max_model_len)
    ps = runner.config.page_size
    pages = -(-n // ps)
    pool = runner.pool_cls(runner.layers, pages, ps, runner.kv_format, runner.device,
                           v_layout=runner.settings.v_layout)
    be = runner.settings.backend_cls(pool, runner.dtype,
                                     runner.model_cls.sm_scale(runner.hf_config))
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    base = torch.cuda.memory_allocated(runner.device)
    be.prepare(build_metadata([n], [n], [list(range(pages))], ps, runner.device,
                              residual_slots=one_slot(pool)))
    ids = torch.randint(0, runner.hf_config.vocab_size, (n,), device=runner.device)
    h = runner.model(ids, torch.arange(n, device=runner.device),
                     Context(be, pool, runner.dtype))
    runner.model.compute_logits(h[-min(n, runner.config.max_num_seqs):])
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - base
    del pool, be, h
    torch.cuda.empty_cache()
    return peak
