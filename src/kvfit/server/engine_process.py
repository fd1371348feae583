"""The engine core in a child process (``EngineLoop(process=True)``): why, in ``engine_loop``.

One duplex ``multiprocessing`` pipe. Server → engine: pickled lists of commands, written by a
sender thread (so a busy engine never blocks the event loop). Engine → server: pickled messages
``("ready", max_model_len, stats)``, ``("start_failed", message, user_error)``,
``("step", events, stats)`` (``engine_core``), ``("died", message)`` and ``("stopped", stats)``,
read by a receiver thread that hands each step to ``EngineLoop._deliver``. The child ignores
SIGINT (the server coordinates shutdown) and exits when the pipe closes, so a killed server
leaves no engine behind; an engine process that exits without a word is reported as dead.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import queue
import signal
from typing import Any, Callable

logger = logging.getLogger("kvfit.server")

_PROTO = pickle.HIGHEST_PROTOCOL


def _engine_main(factory: Callable[[], Any], conn, log_level: int) -> None:
    """The child: build the engine, then run the core until ``stop`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvfit.server.engine_core import CoreLoop
    from kvfit.server.engine_loop import USER_ERRORS

    def send(msg) -> None:
        conn.send_bytes(pickle.dumps(msg, protocol=_PROTO))

    try:
        eng = factory()
    except BaseException as e:  # noqa: BLE001 - reported to the server, which logs it
        if not isinstance(e, USER_ERRORS):
            logger.exception("engine failed to start")
        send(("start_failed", f"{type(e).__name__}: {e}", isinstance(e, USER_ERRORS)))
        return
    send(("ready", eng.max_model_len, dict(eng.stats())))

    def get_commands(block: bool):
        cmds: list = []
        try:
            if block and not conn.poll(0.5):
                return cmds
            while conn.poll():
                cmds += pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None  # the server is gone
        return cmds

    try:
        CoreLoop(eng, get_commands, lambda events, stats: send(("step", events, stats))).run()
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine loop died")
        try:
            send(("died", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    try:
        send(("stopped", dict(eng.stats())))
    except OSError:
        pass


def start_engine_process(loop) -> None:
    """Start the child and the two pipe threads of ``loop`` (an ``EngineLoop``)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    conn, child_conn = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_engine_main, name="kvfit-engine-core", daemon=True,
                       args=(loop._factory, child_conn, logging.getLogger().getEffectiveLevel()))
    proc.start()
    child_conn.close()
    loop._proc = proc
    loop._spawn(lambda: _receive(loop, conn, proc), "kvfit-engine-recv")
    loop._spawn(lambda: _send(loop, conn), "kvfit-engine-send")


def _send(loop, conn) -> None:
    """Sender thread: the command queue → the pipe, batched; ends after ``stop``."""
    while True:
        cmds = loop._get_commands(True)
        if not cmds:
            if not loop._proc.is_alive():
                return
            continue
        try:
            conn.send_bytes(pickle.dumps(cmds, protocol=_PROTO))
        except OSError:
            return  # the engine process is gone; the receiver reports it
        if any(c[0] == "stop" for c in cmds):
            return


def _receive(loop, conn, proc) -> None:
    """Receiver thread: the pipe → ``EngineLoop`` (ready, per-step events, death)."""
    tokenizer = None
    if loop._tokenizer_factory is not None:  # loads while the engine process loads weights
        try:
            tokenizer = loop._tokenizer_factory()
        except Exception as e:  # noqa: BLE001 - the engine reports the real problem
            logger.warning("server-side tokenizer: %s", e)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "step":
            loop._deliver(msg[1], msg[2])
        elif kind == "ready":
            loop._mark_ready(tokenizer, msg[1], msg[2])
        elif kind == "start_failed":
            loop._start_failed(msg[1], msg[2], None)
            return
        elif kind == "died":
            loop._die(msg[1])
            return
        elif kind == "stopped":
            loop._stats = msg[1]
            loop._finish_stopped()
            return
    proc.join(5)
    if loop.state in ("starting", "ready"):
        msg = f"the engine process exited unexpectedly (exit code {proc.exitcode})"
        if loop.state == "starting":
            loop._start_failed(msg, False, None)
        else:
            logger.error(msg)
            loop._die(msg)
    else:
        loop._finish_stopped()


def tokenizer_for(config) -> Any:
    """The server side's tokenizer for ``config`` (None when the model has none: token ids)."""
    from kvfit.models.registry import load_tokenizer, resolve_model

    src = resolve_model(config.model)
    try:
        return load_tokenizer(src, config.tokenizer)
    except Exception:
        if src.kind != "config":
            raise
        return None
