"""The fast Walsh-Hadamard transform of head vectors: ``x @ H`` for the normalized Sylvester
Hadamard matrix H of size D (a power of two; ``H @ H.T = I``, H symmetric), as the KV
transform's rotation of q and k (docs: the format contract).

``fwht_rows`` (Triton, in registers) and ``fwht`` (torch) run the same butterflies in the same
order in float32 (stage s pairs element i with i + 2**s: (a + b, a - b)), then multiply by
float32(1/sqrt(D)), so they give the same bits; both equal ``x @ H`` up to float32 rounding.
Owns nothing.
"""

from __future__ import annotations

import functools
import math

import torch

from kvfit.kernels.interpret import expose_for_interpreter


@functools.lru_cache(maxsize=None)  # called per launch: no tensor built on the host each time
def fwht_scale(d: int) -> float:
    """The normalization 1/sqrt(d), as the float32 the kernels multiply by."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., D]`` -> float32 ``x @ H`` by butterflies (the kernels' order). D a power of 2."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {d}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        z = y.reshape(-1, d // (2 * h), 2, h)  # [R, blocks, 2, h]: the pair on axis 2
        a, b = z[:, :, 0], z[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return (y * fwht_scale(d)).reshape(*lead, d)


@functools.cache
def build():
    """The jitted ``fwht_rows(x, R, D, LOG2D, SCALE)``: float32 x [R, D] -> x @ H (compiled
    into callers; R and D = 2**LOG2D powers of two, SCALE = ``fwht_scale(D)``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _butterfly(x, R: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
        # one stage: element i pairs with i + H inside blocks of 2H -> (a + b, a - b). Only
        # reshape, masked sums (exact: one term is 0) and a broadcast select, no split/join.
        y = tl.reshape(x, (R, D // (2 * H), 2, H))  # the pair on axis 2
        first = (tl.arange(0, 2) == 0)[None, None, :, None]
        a = tl.sum(tl.where(first, y, 0.0), axis=2)  # [R, D / 2H, H]
        b = tl.sum(tl.where(first, 0.0, y), axis=2)
        out = tl.where(first, (a + b)[:, :, None, :], (a - b)[:, :, None, :])
        return tl.reshape(out, (R, D))

    @triton.jit
    def fwht_rows(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
                  SCALE: tl.constexpr):
        # stages of stride 1, 2, 4, ... (D <= 512), each a constexpr branch (the cast also keeps
        # ``tl`` in this function's closure, where Triton resolves the annotations)
        x = x.to(tl.float32)
        if D >= 2:
            x = _butterfly(x, R, D, 1)
        if D >= 4:
            x = _butterfly(x, R, D, 2)
        if D >= 8:
            x = _butterfly(x, R, D, 4)
        if D >= 16:
            x = _butterfly(x, R, D, 8)
        if D >= 32:
            x = _butterfly(x, R, D, 16)
        if D >= 64:
            x = _butterfly(x, R, D, 32)
        if D >= 128:
            x = _butterfly(x, R, D, 64)
        if D >= 256:
            x = _butterfly(x, R, D, 128)
        if D >= 512:
            x = _butterfly(x, R, D, 256)
        return x * SCALE

    expose_for_interpreter(globals(), locals())
    return fwht_rows
