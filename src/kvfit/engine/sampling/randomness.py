"""Counter-based randomness for sampling: one uniform per (seed, position), no RNG state.

The scheme
----------
Every sampled token draws exactly one uniform number ``u`` in (0, 1), computed as a pure function
of two integers: the request's 64-bit sampling seed and the *position* of the token being sampled
(its index in prompt + output): ``u = ((mix(mix(seed + c) ^ position) >> 12) + 0.5) / 2^52`` where
``mix`` is SplitMix64's finaliser (a bijective 64-bit mixer with full avalanche), evaluated on
the host for the whole step in a few vectorised uint64 numpy ops (wrapping arithmetic). The
uniforms travel to the device with the other per-row parameters; the sampler then inverts the
CDF of the row's filtered distribution (token-id order) at ``u`` (see ``sampling.sampler``).

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

The uniforms are computed on the host, so they are identical whatever the device samples.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping multiplications)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Python int seeds (any sign or size, taken mod 2^64) and positions -> float64 [N] in (0, 1).

    A pure function of each row's (seed, position): rows never influence each other.
    """
    s = np.fromiter((x & _MASK64 for x in seeds), dtype=np.uint64, count=len(seeds))
    p = np.fromiter((x & _MASK64 for x in positions), dtype=np.uint64, count=len(positions))
    with np.errstate(over="ignore"):
        z = _mix(_mix(s + np.uint64(0x9E3779B97F4A7C15)) ^ p)
    return ((z >> np.uint64(12)).astype(np.float64) + 0.5) / float(1 << 52)  # never 0, never 1
