"""A tensor-parallel worker process (rank >= 1): ``python -m kvfit.engine.tp_worker`` reads its
``WorkerSpec`` from stdin, joins the group, builds its shard of the model and KV pool (the same
``ModelRunner`` code rank 0 runs) and runs every step rank 0 broadcasts until told to stop.
Exits when stdin closes (rank 0 is gone)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading


def _exit_when_parent_goes(stream) -> None:
    while stream.read(4096):
        pass
    os._exit(0)


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_when_parent_goes, args=(sys.stdin.buffer,), daemon=True,
                     name="kvfit-tp-parent").start()
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s kvfit[tp rank {spec.rank}]: %(message)s")
    from kvfit.engine.runner import ModelRunner
    from kvfit.engine.settings import resolve_settings
    from kvfit.models.gguf_readers import shared_gguf_readers

    with shared_gguf_readers():  # a GGUF's metadata parsed once for config and weights
        runner = ModelRunner(resolve_settings(spec.config), tp_rank=spec.rank,
                             init_method=spec.init_method)
    runner.serve_steps()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - rank 0 sees the exit code; the log has the cause
        logging.getLogger("kvfit").exception("tensor-parallel worker failed")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the stdin watcher thread may hold the stdin lock
