"""Joining the tensor-parallel group: one call per rank, the same on rank 0 and the workers."""

from __future__ import annotations

import datetime
import os
import sys

import torch

from kvfit.parallel.state import TPGroup, set_tp_group

# a collective that waits longer than this is abandoned with an error (gloo and NCCL)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def join_group(rank: int, size: int, init_method: str, device_type: str) -> TPGroup:
    """Initialise torch.distributed for ``rank`` of ``size`` and install the group: NCCL for
    activations on CUDA (rank r on cuda:r, NVLink multicast off) plus a gloo group for the
    step messages; gloo for both on CPU. Blocks until every rank has joined."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        # every rank is on this host: gloo over loopback, whether or not the hostname resolves
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one "
                           "tensor-parallel engine per process (close the other one first)")
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device docs)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT, device_id=device)
        cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        group = TPGroup(rank, size, dist.group.WORLD, cpu_group)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        group = TPGroup(rank, size, dist.group.WORLD, dist.group.WORLD)
    set_tp_group(group)
    return group


def leave_group() -> None:
    """Tear the group down (this process may then build another engine)."""
    import torch.distributed as dist

    set_tp_group(TPGroup())
    if dist.is_initialized():
        dist.destroy_process_group()
