"""One launched step whose sampled tokens the host has not read yet (the overlap scheduler's unit).

``launch_sampling`` turns a step's logits into the chosen token ids as a DEVICE tensor with the
batched sampler (engine/sampling; no host sync), starts their non-blocking copy to pinned host
memory and records an event; ``InFlightStep`` keeps what the engine needs to process the step
later (``wait_ids`` blocks on that event only). The next step reads decode inputs straight from
the device ids, so the host can schedule and launch step N+1 while the GPU still runs step N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvfit.engine.sampling import SamplerOutput, SamplingBatch, sample
from kvfit.scheduler.request import Request


@dataclass
class InFlightStep:
    """A launched step. ``items`` = the scheduled (request, n_new) pairs; ``samplers`` the requests
    that sample, in row order of ``sampled.token_ids`` (device) / ``ids_host`` (pinned, filled
    asynchronously); ``sampled`` also holds the logprobs of requests that asked for them.
    ``prompt_rows`` maps an item index to (start position, [n, V] prompt log-softmax)."""

    items: list[tuple[Request, int]]
    samplers: list[Request]
    sampled: Optional[SamplerOutput]
    ids_host: Optional[torch.Tensor]
    event: Optional[torch.cuda.Event]
    prompt_rows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def wait_ids(self) -> list[int]:
        """The sampled ids on the host (blocks until the step's copy has landed)."""
        if self.ids_host is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.ids_host.tolist()


def launch_sampling(logits: torch.Tensor, samplers: list[Request], bitmask=None):
    """Sample on the device with the batched sampler (the token at position ``num_tokens`` of
    each request, before its placeholder is appended, so seeded draws equal the synchronous
    path's) and start the ids' copy to the host. Returns (sampled, ids_host, event)."""
    if not samplers:
        return None, None, None
    batch = SamplingBatch.build([r.params for r in samplers], [r.sampling_seed for r in samplers],
                                [r.num_tokens for r in samplers], logits.shape[-1], logits.device)
    sampled = sample(logits, batch, token_bitmask=bitmask)
    ids = sampled.token_ids
    if ids.is_cuda:
        ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        ids_host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        ids_host, event = ids, None
    return sampled, ids_host, event
