"""The pinned ring behind ``transfer.to_device`` (kvfit/transfer.py), on CPU with pinning off:
copies equal their inputs in every carried dtype and shape, are never aliases of the input or of
each other when slabs are reused around the ring, and slabs grow for large inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfit.transfer import _NP_TO_TORCH, PinnedRing, to_device


@pytest.mark.parametrize("dtype", sorted(_NP_TO_TORCH, key=str))
def test_ring_copies_every_dtype_and_shape(dtype):
    ring = PinnedRing("cpu", num_slabs=3, pin=False)
    rng = np.random.default_rng(0)
    for shape in [(0,), (1,), (7,), (3, 5), (2, 3, 4), ()]:
        x = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
        out = ring.copy(x)
        assert out.dtype == _NP_TO_TORCH[np.dtype(dtype)] and tuple(out.shape) == x.shape
        assert np.array_equal(out.numpy(), x)


def test_ring_reuse_never_aliases_and_grows():
    ring = PinnedRing("cpu", num_slabs=2, pin=False)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-2**40, 2**40, size=int(n)) for n in rng.integers(1, 3000, size=9)]
    outs = [ring.copy(x) for x in xs]  # 9 copies through 2 slabs
    for x, out in zip(xs, outs):
        assert np.array_equal(out.numpy(), x)
    x = xs[0].copy()
    out = ring.copy(x)
    x[:] = 0  # the copy does not alias its input
    assert np.array_equal(out.numpy(), xs[0])
    big = rng.standard_normal(200_000).astype(np.float32)  # 800 KB: a slab grows
    grows = ring.num_grows
    assert np.array_equal(ring.copy(big).numpy(), big) and ring.num_grows == grows + 1
    non_contiguous = np.arange(40, dtype=np.int64).reshape(8, 5).T
    assert np.array_equal(ring.copy(non_contiguous).numpy(), non_contiguous)


def test_to_device_on_cpu_is_a_conversion():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = to_device(x, "cpu")
    assert t.dtype == torch.int32 and torch.equal(t, torch.from_numpy(x))
