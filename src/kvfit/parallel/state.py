"""The tensor-parallel group of this process and its collectives.

One ``TPGroup`` per process, set once at start (``set_tp_group``) before the model is built;
``tp_group()`` is read by the sharded layers (their shapes at construction, their all-reduce in
forward). With one rank (the default) every collective is the identity and costs nothing, so the
single-GPU path is unchanged.

Two process groups: ``device_group`` carries activations (NCCL on CUDA, gloo on CPU) and
``cpu_group`` (gloo) carries the step messages rank 0 sends to the workers, so no host object
ever travels through the GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (``rank`` of ``size``)."""

    rank: int = 0
    size: int = 1
    device_group: Optional[Any] = None
    cpu_group: Optional[Any] = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, the tokenizer and the server."""
        return self.rank == 0


_GROUP = TPGroup()


def tp_group() -> TPGroup:
    return _GROUP


def set_tp_group(group: TPGroup) -> None:
    """Install this process's group (once, at start, before the model is built)."""
    global _GROUP
    _GROUP = group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (the row-parallel layers' one collective); returns x.
    The identity with one rank. Captured into CUDA graphs like any other kernel (NCCL)."""
    g = _GROUP
    if g.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=g.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (vocabulary-parallel logits):
    [..., n] on each rank -> [..., size * n] on every rank, rank order."""
    g = _GROUP
    if g.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x.contiguous(), group=g.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), over the device group."""
    g = _GROUP
    if g.size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=0, group=g.device_group)
    return x


def min_over_ranks(values: list[int]) -> list[int]:
    """Element-wise minimum of ``values`` over the ranks (on the CPU group); ``values`` with
    one rank. Every rank must call it (e.g. the pool's page counts at start)."""
    g = _GROUP
    if g.size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.cpu_group)
    return [int(x) for x in t]


@contextlib.contextmanager
def rank0_shapes(size: int):
    """Build models with rank 0's shard shapes of a ``size``-rank group without joining one
    (weights estimated on the ``meta`` device before start-up). No collective may run inside."""
    global _GROUP
    if size == 1 or _GROUP.size > 1:
        yield
        return
    saved, _GROUP = _GROUP, TPGroup(0, size)
    try:
        yield
    finally:
        _GROUP = saved
