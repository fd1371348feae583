"""Rank 0's handle on the other ranks: starts one worker process per rank, watches them, stops
them.

Workers are fresh interpreters (``python -m kvfit.engine.tp_worker``, the spawn start method's
semantics: nothing inherited but the environment), started with ``subprocess`` rather than
``multiprocessing`` because the server's engine core is itself a daemonic process, which
``multiprocessing`` forbids to have children. A worker reads its ``WorkerSpec`` (pickled) from
its stdin and keeps the pipe open: when rank 0 goes away, for any reason, the pipe closes and
the worker exits, so no worker outlives the engine. A worker that exits while the engine runs
is reported by ``check()`` as ``WorkerLostError`` (the step in flight fails with it; gloo's
collectives fail at once when a peer's socket closes). If rank 0 stays inside a step for
``LOST_GRACE_S`` after the loss (a collective that cannot fail, e.g. NCCL waiting for the dead
peer), the process exits with status 70 rather than hang; an idle engine just fails its next
step.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from kvfit.errors import WorkerLostError

log = logging.getLogger("kvfit")

LOST_GRACE_S = 60.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard: the engine config, its rank, the rendezvous."""

    config: object  # EngineConfig
    rank: int
    size: int
    init_method: str
    log_level: int


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Ranks 1..size-1 as child processes of rank 0."""

    def __init__(self, config, size: int):
        self.size = size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.lost: Optional[str] = None
        self.closing = False
        self.in_step = False  # set by rank 0's runner while it runs a step (collectives)
        self.acknowledged = threading.Event()
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "kvfit.engine.tp_worker"],
                                    stdin=subprocess.PIPE, env=env)
            proc.stdin.write(pickle.dumps(WorkerSpec(config, rank, size, self.init_method,
                                                     level)))
            proc.stdin.flush()  # kept open: closing it tells the worker to exit
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"kvfit-tp-watch-{rank}").start()
        log.info("tensor parallel: started %d worker process(es) (pids %s), rendezvous %s",
                 size - 1, ", ".join(str(p.pid) for p in self.procs), self.init_method)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        if self.closing:
            return
        self._record_loss(rank, proc)
        stuck = 0.0  # seconds rank 0 has spent inside a step since the loss
        while not self.acknowledged.wait(1.0):
            stuck = stuck + 1.0 if self.in_step else 0.0
            if stuck >= LOST_GRACE_S:
                log.critical("the engine has been stuck in a step for %.0f s since it lost a "
                             "worker (a collective that cannot fail): exiting", stuck)
                os._exit(70)

    def _record_loss(self, rank: int, proc: subprocess.Popen) -> None:
        if self.lost is None:
            self.lost = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                         f"{proc.returncode}; the engine cannot continue with {self.size - 1} of "
                         f"{self.size} ranks: restart it")
            log.error(self.lost)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise WorkerLostError if a worker has exited (marks the loss as handled).
        ``wait_s``: after a failed collective, give a dying worker that long to be seen exit
        (the collective may fail before the process is reaped)."""
        deadline = time.monotonic() + wait_s
        while self.lost is None:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self.closing:
                    self._record_loss(rank, proc)
                    break
            if self.lost is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if self.lost is not None:
            self.acknowledged.set()
            raise WorkerLostError(self.lost)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the workers to exit (after rank 0 sent the stop message), else kill them."""
        self.closing = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def shut_down(channel, workers) -> None:
    """Rank 0: tell the workers to stop, wait for them, leave the group."""
    from kvfit.parallel.group_init import leave_group

    if workers.lost is None:
        try:
            channel.send(None)
        except Exception:  # noqa: BLE001 - a worker already gone: close() kills the rest
            pass
    workers.close()
    leave_group()
