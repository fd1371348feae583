"""Host -> device copies that never make the host wait for the GPU.

A copy from pageable host memory waits for the GPU's earlier work to finish; overlap scheduling
prepares step N+1 while the GPU runs step N, so every per-step copy goes through pinned memory
and is non-blocking. On the CPU it is a plain conversion.

The pinned memory comes from a ring of persistent pinned slabs per device (``PinnedRing``), not
from ``Tensor.pin_memory()`` per call: on the H200's host a ``pin_memory()`` of a step's few
kilobytes measured ~90 us (cProfile of the cached-prefix probe, 2026-12-02), and a decode step
makes two such copies (token ids + positions, the sampler's parameters). A slab is rewritten
only after its previous copy has run (a CUDA event per slab); with ``SLABS`` slabs and a few
copies per step, a slab comes back after several steps, by which time its copy has long run.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import numpy as np
import torch

SLABS = 16  # slabs per device: several steps of copies before one is reused
MIN_SLAB_BYTES = 1 << 16

_NP_TO_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.int16): torch.int16, np.dtype(np.uint8): torch.uint8,
                np.dtype(np.int8): torch.int8, np.dtype(np.bool_): torch.bool,
                np.dtype(np.float16): torch.float16}


class PinnedRing:
    """Owns ``num_slabs`` host byte buffers for copies to ``device`` (pinned when ``pin``),
    used in turn and grown on demand, and one event per slab marking when its last copy has run
    (None without CUDA). ``copy(x)`` returns a new device tensor equal to ``x``; it never
    mutates ``x`` and waits only for a slab whose previous copy has not run yet."""

    def __init__(self, device: Union[torch.device, str], num_slabs: int = SLABS,
                 pin: Optional[bool] = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.pin = cuda if pin is None else pin
        self.num_slabs = num_slabs
        self._slabs: list[Optional[torch.Tensor]] = [None] * num_slabs  # uint8 [capacity]
        self._events: list[Optional[torch.cuda.Event]] = [None] * num_slabs
        self._use_events = cuda
        self._next = 0
        self._lock = threading.Lock()
        self.num_waits = 0  # copies that had to wait for a slab (a ring too small)
        self.num_grows = 0

    def _slab(self, nbytes: int) -> tuple[int, torch.Tensor]:
        j = self._next
        self._next = (j + 1) % self.num_slabs
        ev = self._events[j]
        if ev is not None and not ev.query():
            self.num_waits += 1
            ev.synchronize()  # the slab's previous copy has not run yet
        slab = self._slabs[j]
        if slab is None or slab.numel() < nbytes:
            cap = max(MIN_SLAB_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
            # a replaced pinned slab is released through torch's caching host allocator, which
            # keeps it until the copies that used it have run
            slab = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin)
            self._slabs[j] = slab
            self.num_grows += 1
        return j, slab

    def copy(self, x: np.ndarray) -> torch.Tensor:
        """``x`` (any shape, a dtype of ``_NP_TO_TORCH``) on the device: one non-blocking copy."""
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)  # (ndim >= 1: only 0-d arrays are always contiguous)
        dtype = _NP_TO_TORCH[x.dtype]
        with self._lock:
            j, slab = self._slab(x.nbytes)
            host = slab[:x.nbytes]
            if x.nbytes:
                host.numpy()[:] = x.reshape(-1).view(np.uint8)
            out = torch.empty(x.shape, dtype=dtype, device=self.device)
            if x.nbytes:
                out.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
            if self._use_events:
                ev = self._events[j] or torch.cuda.Event()
                ev.record()
                self._events[j] = ev
        return out


_RINGS: dict[torch.device, PinnedRing] = {}


def _ring(device: torch.device) -> PinnedRing:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedRing(device)
    return ring


def to_device(x: Union[np.ndarray, torch.Tensor], device: Union[torch.device, str]) -> torch.Tensor:
    """One host->device copy of ``x`` (a numpy array or a host tensor); through the device's
    pinned ring and non-blocking on CUDA (a dtype the ring does not carry: pinned per call)."""
    device = torch.device(device)
    if device.type != "cuda":
        t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return t.to(device)
    if (isinstance(x, np.ndarray) and x.dtype in _NP_TO_TORCH
            and not torch.cuda.is_current_stream_capturing()):  # a capture records no ring events
        return _ring(device).copy(x)
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.pin_memory().to(device, non_blocking=True)
