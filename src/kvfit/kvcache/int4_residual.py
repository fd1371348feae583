"""The int4 pool's residual buffer bookkeeping: which slot each request owns, and one step's store plan.

The int4 pool keeps each running request's last, partial page in full precision (one page of K
and V per layer in a residual slot) and quantizes it into the request's pool page when it fills.

* ``ResidualSlots`` (pure CPU, like ``PageAllocator``): ``max_num_seqs`` slots; the scheduler
  assigns one to a request when it first gives it pages (``Scheduler.grow``) and releases it with
  the pages (finish, abort, preemption). A request keeps its slot while it runs, so the tokens
  of its partial page written in earlier steps are still there when the page fills.
* ``ResidualPlan`` (built once per step from host lists, ``plan_residual_store``): where every
  new token goes. Tokens of pages that become full this step are staged with the earlier tokens
  of their page (read from the residual slot) and quantized as whole pages; the tokens of a
  request's new partial page go to its residual slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvfit.transfer import to_device


class ResidualSlots:
    """``num_slots`` residual slots and the request that holds each. Mutated by the scheduler."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the int4 pool needs at least one residual slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._owner

    def can_assign(self, request_id: str) -> bool:
        """True if ``request_id`` holds a slot or one is free."""
        return request_id in self._owner or bool(self._free)

    def assign(self, request_id: str) -> int:
        """The slot of ``request_id``, taking a free one if it holds none (RuntimeError if none
        is free: the scheduler admits at most ``max_num_seqs`` requests, one slot each)."""
        slot = self._owner.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"no free residual slot for request {request_id!r} "
                                   f"({self.num_slots} slots, one per running request)")
            slot = self._owner[request_id] = self._free.pop()
        return slot

    def slot(self, request_id: str) -> int:
        """The slot ``request_id`` holds (KeyError naming the cause if it holds none)."""
        try:
            return self._owner[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no residual slot of the int4 pool: "
                           "the scheduler assigns one when it gives the request pages") from None

    def release(self, request_id: str) -> None:
        """Give back ``request_id``'s slot (nothing if it holds none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


@dataclass
class ResidualPlan:
    """One step's int4 store, the same for every layer (device tensors, int64).

    full_pages [F]:       pool pages that become full this step (quantized whole).
    stage_res_* [R]:      staged rows read from residual slots: staged page index, offset in the
                          page, residual slot (the offset in the slot is the same).
    stage_new_* [N]:      staged rows from this step's tokens: staged page index, offset, token.
    tail_* [M]:           tokens that go to residual slots: token index, slot, offset.
    slots_cpu:            each request's residual slot (-1 for padding rows), for readers.
    slots:                the same as a device tensor, int32 ``[B]`` (the triton decode reads it).
    """

    full_pages: torch.Tensor
    stage_res_page: torch.Tensor
    stage_res_off: torch.Tensor
    stage_res_slot: torch.Tensor
    stage_new_page: torch.Tensor
    stage_new_off: torch.Tensor
    stage_new_tok: torch.Tensor
    tail_tok: torch.Tensor
    tail_slot: torch.Tensor
    tail_off: torch.Tensor
    slots_cpu: list[int]
    slots: torch.Tensor

    @property
    def num_full_pages(self) -> int:
        return int(self.full_pages.shape[0])


def plan_residual_store(q_lens: Sequence[int], kv_lens: Sequence[int],
                        page_tables: Sequence[Sequence[int]], slots: Sequence[int],
                        page_size: int, device: torch.device) -> ResidualPlan:
    """The int4 store of a step: request i writes positions ``kv_lens[i] - q_lens[i] ..
    kv_lens[i] - 1`` (its tokens sit in the flat batch in request order), its pages are
    ``page_tables[i]``, its residual slot ``slots[i]`` (< 0: a padding row that stores nothing).
    """
    full, res, new, tail = [], [], [], []  # lists of per-request numpy blocks
    tok0 = 0
    for q, kv, pages, slot in zip(q_lens, kv_lens, page_tables, slots):
        q, kv = int(q), int(kv)
        start = kv - q
        if q == 0 or slot < 0:
            tok0 += q
            continue
        first, end_full = start // page_size, kv // page_size  # pages [first, end_full) fill
        for p in range(first, end_full):
            f = len(full)  # staged index of this page
            full.append(np.array([pages[p]], dtype=np.int64))
            lo = max(start, p * page_size)  # first new position in page p
            if lo > p * page_size:  # earlier tokens of the page wait in the residual slot
                offs = np.arange(0, lo - p * page_size, dtype=np.int64)
                res.append(np.stack([np.full_like(offs, f), offs, np.full_like(offs, slot)]))
            pos = np.arange(lo, (p + 1) * page_size, dtype=np.int64)
            new.append(np.stack([np.full_like(pos, f), pos % page_size, tok0 + pos - start]))
        lo = max(start, end_full * page_size)
        if lo < kv:  # the new partial page
            pos = np.arange(lo, kv, dtype=np.int64)
            tail.append(np.stack([tok0 + pos - start, np.full_like(pos, slot), pos % page_size]))
        tok0 += q

    def rows(blocks: list, n: int) -> list[torch.Tensor]:
        a = np.concatenate(blocks, axis=1) if blocks else np.zeros((n, 0), dtype=np.int64)
        return list(to_device(np.ascontiguousarray(a), device))

    full_pages = to_device(np.concatenate(full) if full else np.zeros(0, np.int64), device)
    slots_cpu = [int(s) for s in slots]
    return ResidualPlan(full_pages, *rows(res, 3), *rows(new, 3), *rows(tail, 3),
                        slots_cpu=slots_cpu,
                        slots=to_device(np.asarray(slots_cpu, dtype=np.int32), device))


def graph_residual_plan(slots: torch.Tensor, batch: int) -> ResidualPlan:
    """The residual plan of a CUDA-graph decode step: ``slots`` ``[batch]`` int32, a static
    device buffer the graph runner fills each step (-1: padding). Decode steps store through
    ``kernels/int4_store.py``, which reads only the slots; the index lists are empty and
    ``slots_cpu`` is all -1 (the host does not know the replayed step's slots)."""
    empty = torch.zeros(0, dtype=torch.int64, device=slots.device)
    return ResidualPlan(empty, *(empty,) * 9, slots_cpu=[-1] * batch, slots=slots)
