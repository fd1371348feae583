"""K centering and Hadamard rotation of the KV cache: what a pool's stored K (and V) are relative
to the model's own k/v.

``KVTransform`` (``pool.kv_transform``; None when off) holds, per layer, an optional float32 mean
``k_mean[layer]`` ``[num_kv_heads, head_dim]`` of the post-RoPE keys (calibrated at start,
engine/kv_calibration.py) and a flag ``rotate`` for an orthonormal Hadamard rotation per head.
Backends that declare it (``AttentionBackend.kv_transforms``) call ``transform_qk`` after RoPE,
before storing and attending:

    k' = (k - k_mean[layer]) @ H        q' = q @ H

Exactness. ``q' . k' = q . (k - mu) = q . k - q . mu``: every logit of one query row (and head)
shifts by the same ``q . mu``, which softmax ignores. A layer with attention-logit soft-capping
is not shift invariant: its backend adds ``sm_scale * q . mu`` (``logit_shift``) back before the
cap. V needs no runtime work: H is folded into each head's rows of ``v_proj`` and the matching
columns of ``o_proj`` when weights load (models/kv_rotation_fold.py), so v arrives rotated and
o_proj undoes it. Why: centering removes Qwen's constant per-channel K offsets (up to ~217)
that waste an int8 row's range; the rotation spreads outlier channels over the row
(issue 14's measurements: both are needed for int8; rotation is measured unsafe for fp8).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Optional, Sequence

import torch


@lru_cache(maxsize=None)
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(torch.float32)


def hadamard(d: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``[d, d]`` float32: symmetric, ``H @ H.T = I``.
    ``d`` must be a power of two (ValueError otherwise)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    return _hadamard_cpu(d).clone()


class KVTransform:
    """Per-layer K centering and per-head Hadamard rotation (see the module docstring).

    ``k_mean``: one entry per layer, a float32 ``[num_kv_heads, head_dim]`` tensor or None
    (centering off for that layer). ``rotate``: rotate q, k (and, by the weight fold, v).
    ``source`` says where the means came from (logged; part of the identity). Immutable after
    construction; tensors move to ``device``.
    """

    def __init__(self, k_mean: Sequence[Optional[torch.Tensor]], rotate: bool,
                 device: torch.device | str = "cpu", source: str = ""):
        self.k_mean = [None if m is None else m.detach().to(device=device, dtype=torch.float32)
                       for m in k_mean]
        self.rotate = bool(rotate)
        self.source = source
        self._h: dict[int, torch.Tensor] = {}
        if self.rotate:
            for d in {m.shape[-1] for m in self.k_mean if m is not None}:
                hadamard(d)  # raises for a non-power-of-two head_dim now, not at the first step
        self.device = torch.device(device)
        # the identity digest, once: the means never change, and reading them back from the
        # device on every call synchronized the host with the GPU (the scheduler asks for the
        # identity in every step that admits requests: 28 stream syncs per step on Qwen3-1.7B,
        # which broke overlap scheduling)
        d = hashlib.sha256()
        for m in self.k_mean:
            d.update(b"-" if m is None else m.detach().cpu().contiguous().numpy().tobytes())
        self._digest = d.hexdigest()

    @property
    def num_layers(self) -> int:
        return len(self.k_mean)

    @property
    def centers(self) -> bool:
        return any(m is not None for m in self.k_mean)

    @property
    def is_identity(self) -> bool:
        return not self.rotate and not self.centers

    def h(self, d: int) -> torch.Tensor:
        """H ``[d, d]`` float32 on this transform's device (cached)."""
        if d not in self._h:
            self._h[d] = hadamard(d).to(self.device)
        return self._h[d]

    def transform_qk(self, layer_id: int, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` (after RoPE) -> (q', k') in float32: k' = (k -
        mean) @ H, q' = q @ H; identity parts skipped (then the input is returned as is)."""
        mean = self.k_mean[layer_id]
        if mean is not None:
            k = k.float() - mean  # [T, Hkv, D] - [Hkv, D]
        if self.rotate:
            h = self.h(q.shape[-1])
            q = torch.matmul(q.float(), h)
            k = torch.matmul(k.float(), h)
        return q, k

    def logit_shift(self, layer_id: int, q: torch.Tensor) -> Optional[torch.Tensor]:
        """``q . mean`` per query token and head, ``[T, Hq]`` float32 (q un-transformed, post-RoPE),
        what centering took off every logit of the row; None when the layer is not centered.
        GQA: query head j reads KV head ``j // (Hq // Hkv)``."""
        mean = self.k_mean[layer_id]
        if mean is None:
            return None
        group = q.shape[1] // mean.shape[0]
        return (q.float() * mean.repeat_interleave(group, dim=0)).sum(-1)

    def identity(self) -> tuple:
        """What the stored bytes depend on (prefix caching's KV identity): the rotation and a
        digest of every mean."""
        return ("kv_transform", self.rotate, self._digest)

    def describe(self) -> str:
        parts = []
        if self.centers:
            parts.append(f"K centered ({self.source or 'given means'})")
        if self.rotate:
            parts.append("K/V Hadamard-rotated per head")
        return ", ".join(parts) or "none"
