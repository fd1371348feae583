"""Functions a test hands to every tensor-parallel rank (``ModelRunner.collective_call``):
the workers import them by module name, so this module is on their path (the test puts
tests/ on PYTHONPATH)."""

from __future__ import annotations

import torch


def _caches(pool) -> list[torch.Tensor]:
    return list(getattr(pool, "kv_caches", None) or (*pool.k_caches, *pool.v_caches))


def poison_pool(runner) -> None:
    """NaN into every element of the rank's pool."""
    for t in _caches(runner.pool):
        t.fill_(float("nan"))


def pool_sums(runner) -> list[float]:
    """Sum of |x| over each rank's pool, every rank's in rank order (a gloo all-gather)."""
    import torch.distributed as dist

    from kvfit.parallel.state import tp_group

    total = torch.tensor([float(sum(t.float().abs().sum() for t in _caches(runner.pool)))])
    g = tp_group()
    if g.size == 1:
        return [total.item()]
    parts = [torch.zeros(1) for _ in range(g.size)]
    dist.all_gather(parts, total, group=g.cpu_group)
    return [p.item() for p in parts]
