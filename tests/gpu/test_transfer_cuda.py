"""``transfer.to_device`` through the pinned ring on the GPU: copies enqueued behind a long
kernel queue, more of them than the ring has slabs, each equal to its input once the queue has
run (a slab is never rewritten before its copy ran: the ring waited when it wrapped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfit import transfer

pytestmark = pytest.mark.gpu


def test_ring_copies_behind_a_busy_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = transfer.PinnedRing(dev, num_slabs=4)
    a = torch.randn(4096, 4096, device=dev)
    rng = np.random.default_rng(0)
    xs, outs = [], []
    for i in range(12):  # 3x the slabs: slabs are reused while the stream is still busy
        for _ in range(3):
            a = a @ a * 1e-3  # queue GPU work ahead of the copy
        x = rng.integers(-2**40, 2**40, size=int(rng.integers(1, 50_000)))
        xs.append(x)
        outs.append(ring.copy(x))
        x_mutated = x.copy()
        x[:] = -1  # the host's array changes after the call: the copy must not see it
        xs[-1] = x_mutated
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        assert np.array_equal(out.cpu().numpy(), x)
    assert ring.num_waits >= 1  # the ring wrapped while copies were queued, and waited


def test_to_device_uses_the_ring_and_keeps_dtypes():
    dev = torch.device("cuda")
    ring = transfer._ring(dev)
    start = ring._next
    dtypes = (np.int64, np.int32, np.float32, np.float64, np.bool_)
    for dtype in dtypes:
        x = (np.arange(37) % 5).astype(dtype)
        t = transfer.to_device(x, dev)
        assert t.is_cuda and t.dtype == torch.from_numpy(x).dtype
        assert torch.equal(t.cpu(), torch.from_numpy(x))
    assert (ring._next - start) % ring.num_slabs == len(dtypes)  # each copy took a ring slab
