"""Programmatic dependent launch (PDL, Hopper and newer) for the Triton kernels of a decode step.

A kernel launched with PDL may be scheduled while the previous kernel on the stream is still
finishing; it waits (``griddepcontrol.wait``) for that kernel's completion and memory before its
first instruction that touches memory, then lets its own successor be scheduled early
(``griddepcontrol.launch_dependents``). What this saves is the gap between two kernels (launch
latency, block scheduling), ~1-2 us per kernel boundary, which at batch 1 is paid ~200 times per
step. Correctness does not depend on the predecessor: a kernel that is not PDL-aware (cuBLAS, a
copy) simply completes before the wait returns.

``gdc()`` gives the two builtins a participating kernel runs first (inline, under its ``PDL``
constexpr); ``launch_options(device)`` is what its launch passes (the ``PDL`` constexpr and
Triton's ``launch_pdl``). ``ENABLED`` turns it on (off by default until measured on the GPU).
"""

from __future__ import annotations

import functools

import torch

ENABLED = False


def gdc():
    """(gdc_wait, gdc_launch_dependents): Triton's grid-dependency-control builtins, or (None,
    None) for a Triton without them (then ``launch_options`` never asks for PDL). Kernels bind
    them in their build() and run them first under their ``PDL`` constexpr:

        if PDL:
            gdc_wait()
            gdc_launch_dependents()
    """
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None, None
    return gdc_wait, gdc_launch_dependents


@functools.cache
def _supported(device_index: int) -> bool:
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a participating kernel's launch on ``device``."""
    if ENABLED and device.type == "cuda" and _supported(device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
