"""How rank 0 hands each step to the other ranks: one pickled message broadcast over the gloo
(CPU) group.

A step's message (token ids, positions, lengths, page tables, which rows sample) is a few KiB;
``StepChannel.send`` broadcasts it in one fixed-size buffer (``HEADER_BYTES``, the length in
its first 8 bytes), plus a second broadcast only for what does not fit. Workers block in the
receive (a socket read: no spinning core). Measured against a queue per worker on CPU: see
``benchmarks/tp/step_transport.py`` and docs/tensor_parallel.md.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

HEADER_BYTES = 64 * 1024
_LEN = struct.Struct("<Q")


class StepChannel:
    """Rank 0 ``send``s, every other rank ``recv``s the same sequence of objects (a step plan,
    a ``RankCall``, ``None`` meaning stop). Every rank must call in the same order (it is a
    collective)."""

    def __init__(self, cpu_group, header_bytes: int = HEADER_BYTES):
        self.group = cpu_group
        self.buf = torch.zeros(header_bytes, dtype=torch.uint8)
        self.cap = header_bytes - _LEN.size

    def send(self, obj: Any) -> None:
        import torch.distributed as dist

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = min(len(data), self.cap)
        view = self.buf.numpy()
        _LEN.pack_into(view, 0, len(data))
        view[_LEN.size:_LEN.size + head] = memoryview(data)[:head]
        dist.broadcast(self.buf, src=0, group=self.group)
        if len(data) > self.cap:
            rest = torch.frombuffer(bytearray(data[self.cap:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def recv(self) -> Any:
        import torch.distributed as dist

        dist.broadcast(self.buf, src=0, group=self.group)
        view = self.buf.numpy()
        (n,) = _LEN.unpack_from(view, 0)
        data = bytes(view[_LEN.size:_LEN.size + min(n, self.cap)])
        if n > self.cap:
            rest = torch.empty(n - self.cap, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


@dataclass(frozen=True)
class RankCall:
    """A message that is not a step: every rank runs ``fn(runner, *args)`` (``fn`` a
    module-level function, pickled by name), e.g. a benchmark filling every rank's pool."""

    fn: Callable[..., Any]
    args: tuple = ()
