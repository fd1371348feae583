"""One launched step whose sampled tokens the host has not read yet (the overlap scheduler's unit).

``launch_sampling`` turns a step's logits into the chosen token ids as a DEVICE tensor (no host
sync), starts their non-blocking copy to pinned host memory and records an event; ``InFlightStep``
keeps what the engine needs to process the step later (``wait_ids`` blocks on that event only).
The next step reads decode inputs straight from ``ids`` on the device, so the host can schedule
and launch step N+1 while the GPU still runs step N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvfit.engine.sampler import _filter
from kvfit.scheduler.request import Request


def sample_ids(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """logits [N, V] float32 -> chosen ids [N] int64 on logits' device, without a host sync.

    Greedy rows take the argmax; other rows draw with the request's own generator after
    temperature / top-k / top-p / min-p (the sampler module's filter), so seeded requests give
    the same tokens as the synchronous path. NOTE: the batched sampler (branch ``sampler``)
    replaces this function; its contract is the same (device tensor of ids in row order)."""
    ids = logits.argmax(dim=-1)  # [N]
    for i, req in enumerate(requests):
        if req.params.greedy:
            continue
        probs = torch.softmax(_filter(logits[i].float(), req.params), -1)
        ids[i:i + 1] = torch.multinomial(probs, 1, generator=req.generator)
    return ids


@dataclass
class InFlightStep:
    """A launched step. ``items`` = the scheduled (request, n_new) pairs; ``samplers`` the requests
    that sample, in row order of ``ids`` (device) / ``ids_host`` (pinned, filled asynchronously).
    ``logprob_rows`` maps a row to its raw log-softmax [V] (only for requests asking for logprobs);
    ``prompt_rows`` maps an item index to (start position, [n, V] prompt log-softmax)."""

    items: list[tuple[Request, int]]
    samplers: list[Request]
    ids: Optional[torch.Tensor]
    ids_host: Optional[torch.Tensor]
    event: Optional[torch.cuda.Event]
    logprob_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    prompt_rows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def wait_ids(self) -> list[int]:
        """The sampled ids on the host (blocks until the step's copy has landed)."""
        if self.ids_host is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.ids_host.tolist()


def launch_sampling(logits: torch.Tensor, samplers: list[Request]):
    """Sample on the device and start the ids' copy to the host. Returns (ids, ids_host, event,
    logprob_rows)."""
    if not samplers:
        return None, None, None, {}
    ids = sample_ids(logits, samplers)
    lp_rows = [i for i, r in enumerate(samplers) if r.params.logprobs is not None]
    logprob_rows = {}
    if lp_rows:
        lp = torch.log_softmax(logits[lp_rows].float(), dim=-1)  # [n_lp, V]
        logprob_rows = {row: lp[j] for j, row in enumerate(lp_rows)}
    if ids.is_cuda:
        ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        ids_host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        ids_host, event = ids, None
    return ids, ids_host, event, logprob_rows
