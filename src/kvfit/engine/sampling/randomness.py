"""Counter-based randomness for sampling: one uniform per (seed, position), no RNG state.

The scheme
----------
Every sampled token draws exactly one uniform number ``u`` in (0, 1), computed as a pure function
of two integers: the request's 64-bit sampling seed and the *position* of the token being sampled
(its index in prompt + output). The function is a hash (a few rounds of a 32-bit integer mixer,
Chris Wellons' "lowbias32", run on int64 tensors with the multiplications split into 16-bit
halves so no intermediate exceeds 2^49) that yields two 32-bit words, joined into 52 random bits
of a float64. The sampler then inverts the CDF of the filtered distribution (token-id order) at
``u`` (see ``kvfit.engine.sampling.sampler``).

Why it is reproducible
----------------------
There is no generator whose state advances, so nothing depends on what else ran before: the
uniform of a token depends only on (seed, position), never on the batch size, the row a request
occupies in the batch, the other requests in it, how many steps ran, or whether the request was
preempted and recomputed (the recomputed request samples the same positions again). The token
chosen from ``u`` depends only on that request's logits row, so a seeded request gives the same
tokens alone, batched and after preemption whenever its logits are the same (the engine's batch
invariance, tested for greedy decoding). Unseeded requests get a seed drawn at admission from the
engine's RNG seeded by ``EngineConfig.seed``, so whole runs repeat too.

The same integer ops run on CPU and CUDA tensors and give bit-identical uniforms on both.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    lo = x * (c & 0xFFFF)  # < 2^48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of x*c_hi survive the shift
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer with good avalanche (int64 lanes in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def split_seeds(seeds: Sequence[int]) -> torch.Tensor:
    """Python ints (any sign or size, taken mod 2^64) -> int64 [N, 2] of (low, high) 32-bit words."""
    words = [((s & _MASK64) & _MASK32, ((s & _MASK64) >> 32) & _MASK32) for s in seeds]
    return torch.tensor(words, dtype=torch.int64).reshape(len(words), 2)


def uniforms(seed_words: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seed_words int64 [N, 2] (from ``split_seeds``), positions int64 [N] -> float64 [N] in (0, 1).

    A pure function of each row's (seed, position): rows never influence each other.
    """
    lo, hi = seed_words[:, 0], seed_words[:, 1]
    pos = positions.to(torch.int64) & _MASK32
    h = _mix32(pos ^ 0x9E3779B9)
    h = _mix32(h ^ hi)
    h = _mix32(h ^ lo)
    a = _mix32(h ^ 0x68E31DA4)  # two further words from the same state
    b = _mix32(a ^ 0xB5297A4D)
    bits52 = ((a >> 6) << 26) | (b >> 6)  # 26 + 26 random bits
    return (bits52.to(torch.float64) + 0.5) / float(1 << 52)  # exact: never 0, never 1
