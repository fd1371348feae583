"""The engine core in a child process (``EngineLoop(process=True)``): why, in ``engine_loop``.

One socket pair, frames of an 8-byte length and a pickle. Server → engine: lists of commands.
Engine → server: ``("ready", max_model_len, vocab_size, stats)``, ``("start_failed", message, user_error)``,
``("step", events, stats)`` (``engine_core``), ``("died", message)`` and ``("stopped", stats)``.

The server's end lives on uvicorn's event loop (``Channel.attach``, called as the server starts):
the loop reads frames when the socket is readable and writes commands without blocking (what
does not fit waits for a writer callback). No extra Python thread runs in the server process:
profiles showed a receiver/sender thread pair costing the event loop milliseconds per request
in GIL hand-offs (each ``SimpleQueue.put`` or syscall of the loop let the other thread in).

The child ignores SIGINT (the server coordinates shutdown) and exits when the socket closes, so
a killed server leaves no engine behind; an engine process that exits without a word is
reported as dead.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import pickle
import select
import signal
import socket
import struct
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger("kvfit.server")

_HEADER = struct.Struct("!Q")
_PROTO = pickle.HIGHEST_PROTOCOL


def _frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=_PROTO)
    return _HEADER.pack(len(data)) + data


def _split_frames(buf: bytearray) -> list:
    """Complete frames at the front of ``buf`` (removed from it), unpickled."""
    out, pos = [], 0
    while len(buf) - pos >= _HEADER.size:
        (n,) = _HEADER.unpack_from(buf, pos)
        if len(buf) - pos - _HEADER.size < n:
            break
        start = pos + _HEADER.size
        out.append(pickle.loads(memoryview(buf)[start:start + n]))
        pos = start + n
    del buf[:pos]
    return out


# ---- the child ------------------------------------------------------------------------------


def _engine_main(factory: Callable[[], Any], sock: socket.socket, log_level: int) -> None:
    """Build the engine, then run the core until ``stop`` or the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvfit.server.engine_core import USER_ERRORS, CoreLoop

    sock.setblocking(True)

    def send(msg) -> None:
        sock.sendall(_frame(msg))

    try:
        eng = factory()
    except BaseException as e:  # noqa: BLE001 - reported to the server, which logs it
        if not isinstance(e, USER_ERRORS):
            logger.exception("engine failed to start")
        send(("start_failed", f"{type(e).__name__}: {e}", isinstance(e, USER_ERRORS)))
        return
    send(("ready", eng.max_model_len, eng.vocab_size, dict(eng.stats())))
    buf = bytearray()

    def get_commands(block: bool):
        cmds: list = []
        timeout = 0.5 if block else 0.0
        try:
            while select.select([sock], [], [], timeout)[0]:
                data = sock.recv(1 << 20)
                if not data:
                    return None  # the server is gone
                buf.extend(data)
                for frame in _split_frames(buf):
                    cmds += frame
                # a partly received frame: the rest is on its way, wait for it
                timeout = 0.5 if buf else 0.0
        except OSError:
            return None
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


# ---- the server's end -----------------------------------------------------------------------


class Channel:
    """The server's end of the socket, driven by one asyncio loop once ``attach``ed. Owns the
    child process; hands its messages to the ``EngineLoop``."""

    def __init__(self, engine_loop, sock: socket.socket, proc):
        self.engine_loop, self.sock, self.proc = engine_loop, sock, proc
        self.aio: Optional[asyncio.AbstractEventLoop] = None
        self._out = bytearray()  # frames not yet written
        self._in = bytearray()
        self._lock = threading.Lock()  # _out and writes (shutdown may come from another thread)
        self._writer_on = False
        self._closed = False
        sock.setblocking(False)

    def attach(self, aio: asyncio.AbstractEventLoop) -> None:
        """Start reading on ``aio`` (call from that loop's thread)."""
        if self.aio is not None or self._closed:
            return
        self.aio = aio
        aio.add_reader(self.sock.fileno(), self._on_readable)
        with self._lock:
            self._flush()

    def submit(self, cmd) -> None:
        """Queue one command; written now if the socket takes it (any thread)."""
        with self._lock:
            if self._closed:
                return
            self._out += _frame([cmd])
            if self.aio is None:
                return  # flushed at attach
            if _in_thread_of(self.aio):
                self._flush()
            elif not self._writer_on:
                self._writer_on = True
                self.aio.call_soon_threadsafe(self._flush_locked)

    def _flush_locked(self) -> None:
        with self._lock:
            self._writer_on = False
            self._flush()

    def _flush(self) -> None:
        """Write what the socket takes; the rest waits for writability (``_lock`` held)."""
        while self._out:
            try:
                n = self.sock.send(self._out)
            except BlockingIOError:
                break
            except OSError:
                self._out.clear()  # the engine is gone; the reader reports it
                return
            del self._out[:n]
        if self.aio is not None and not self._closed:
            if self._out:
                self.aio.add_writer(self.sock.fileno(), self._flush_locked)
            else:
                self.aio.remove_writer(self.sock.fileno())

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 22)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._detach()
            self.engine_loop._engine_gone(self.proc)
            return
        self._in += data
        for msg in _split_frames(self._in):
            kind = msg[0]
            if kind == "step":
                self.engine_loop._deliver(msg[1], msg[2])
            elif kind == "ready":
                self.engine_loop._mark_ready(self.engine_loop.tokenizer, *msg[1:])
            elif kind == "start_failed":
                self.engine_loop._start_failed(msg[1], msg[2], None)
            elif kind == "died":
                self.engine_loop._die(msg[1])
            elif kind == "stopped":
                self.engine_loop._stats = msg[1]

    def stop(self, timeout: float) -> None:
        """Send ``stop``, wait for the child to exit (terminate it after ``timeout``), close."""
        with self._lock:
            if not self._closed:
                self._out += _frame([("stop",)])
                self._write_all(min(timeout, 5.0))
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating", timeout)
            self.proc.terminate()
            self.proc.join(5)
        self._detach()

    def _write_all(self, timeout: float) -> None:
        while self._out:
            if not select.select([], [self.sock], [], timeout)[1]:
                return
            try:
                del self._out[:self.sock.send(self._out)]
            except OSError:
                return

    def _detach(self) -> None:
        if self._closed:
            return
        self._closed = True
        aio = self.aio
        if aio is not None and not aio.is_closed():
            if _in_thread_of(aio) or not aio.is_running():
                self._unregister()
                return
            aio.call_soon_threadsafe(self._unregister)
            return
        self.sock.close()

    def _unregister(self) -> None:
        fd = self.sock.fileno()
        if fd >= 0:
            self.aio.remove_reader(fd)
            self.aio.remove_writer(fd)
        self.sock.close()


def _in_thread_of(aio: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is aio
    except RuntimeError:
        return False


def start_engine_process(engine_loop) -> Channel:
    """Start the child for ``engine_loop`` (an ``EngineLoop``); returns the server's end."""
    if engine_loop._tokenizer_factory is not None:
        try:
            engine_loop.tokenizer = engine_loop._tokenizer_factory()
        except Exception as e:  # noqa: BLE001 - the engine reports the real problem
            logger.warning("server-side tokenizer: %s", e)
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    ours, theirs = socket.socketpair()
    proc = ctx.Process(target=_engine_main, name="kvfit-engine-core", daemon=True,
                       args=(engine_loop._factory, theirs,
                             logging.getLogger().getEffectiveLevel()))
    proc.start()
    theirs.close()
    return Channel(engine_loop, ours, proc)


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
