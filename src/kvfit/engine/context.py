"""Context: what a model forward needs besides its inputs (backend, pool, compute dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfit.attention.base import AttentionBackend
from kvfit.kvcache.pool import KVPool


@dataclass
class Context:
    """Passed explicitly to ``model.forward(input_ids, positions, ctx)``.

    compute_dtype is the query/activation dtype (the model dtype), distinct from ``pool.dtype``
    (the KV element type): queries never go through the KV format.
    """

    backend: AttentionBackend
    pool: KVPool
    compute_dtype: torch.dtype
