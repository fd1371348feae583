"""Rank 0's handle on the other ranks: starts one worker process per rank, watches them, stops
them.

Workers are fresh interpreters (``python -m kvfit.engine.tp_worker``, the spawn start method's
semantics: nothing inherited but the environment), started with ``subprocess`` rather than
``multiprocessing`` because the server's engine core is itself a daemonic process, which
``multiprocessing`` forbids to have children. A worker reads its ``WorkerSpec`` (pickled) from
its stdin and keeps the pipe open: when rank 0 goes away, for any reason, the pipe closes and
the worker exits, so no worker outlives the engine. A worker that exits while the engine runs
is reported by ``check()`` as ``WorkerLostError`` (the step in flight fails with it; gloo's
collectives fail at once when a peer's socket closes). If the engine does not notice within
``LOST_GRACE_S`` (a collective that cannot fail, e.g. NCCL), the process exits with status 70
rather than hang.
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
        code = proc.wait()
        if self.closing:
            return
        self.lost = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                     f"{code}; the engine cannot continue with {self.size - 1} of {self.size} "
                     f"ranks: restart it")
        log.error(self.lost)
        if not self.acknowledged.wait(LOST_GRACE_S):
            log.critical("the engine did not stop within %.0f s of losing a worker: exiting",
                         LOST_GRACE_S)
            os._exit(70)

    def check(self) -> None:
        """Raise WorkerLostError if a worker has exited (marks the loss as handled)."""
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
