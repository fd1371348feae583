"""Host -> device copies that never make the host wait for the GPU.

A copy from pageable host memory waits for the GPU's earlier work to finish; overlap scheduling
prepares step N+1 while the GPU runs step N, so every per-step copy goes through pinned memory
and is non-blocking (torch's caching host allocator keeps the pinned block alive until the copy
has run). On the CPU it is a plain conversion.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch


def to_device(x: Union[np.ndarray, torch.Tensor], device: Union[torch.device, str]) -> torch.Tensor:
    """One host->device copy of ``x`` (a numpy array or a host tensor); pinned and non-blocking
    on CUDA."""
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
