"""Running the app under uvicorn: in the foreground (``kvfit serve``) or in a background thread
on a free loopback port (tests, ``kvfit bench serve`` without ``--base-url``).

Shutdown order (SIGTERM/SIGINT in the foreground, ``stop()`` in the background): uvicorn stops
accepting; ``KvfitUvicorn.shutdown`` first aborts every in-flight request (streams end with an
error event, waiting handlers answer 503) so open connections finish at once; then the lifespan
ends and the engine thread stops (pages freed, thread joined).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn

from kvfit.server.app import build_app
from kvfit.server.engine_loop import EngineLoop


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StartingNote(logging.Filter):
    """Adds to uvicorn's "Uvicorn running on ..." line, printed when the socket is bound, that the
    engine may still be loading (so the line is not read as "ready": /health is 503 until the
    engine loop logs "engine ready")."""

    def __init__(self, engine_loop: EngineLoop):
        super().__init__()
        self.engine_loop = engine_loop

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on")
                and self.engine_loop.state == "starting"):
            record.msg += (" - the engine is still loading: /health answers 503 until the "
                           "'engine ready' line")
        return True


class KvfitUvicorn(uvicorn.Server):
    """uvicorn.Server that serves the engine's socket on its loop (process mode) and aborts the
    engine's in-flight requests when shutdown begins."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = engine_loop

    async def startup(self, sockets=None) -> None:
        self.engine_loop.attach(asyncio.get_running_loop())  # process mode: the engine's socket
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.abort_all("the server is shutting down")
        await super().shutdown(sockets)
        self.engine_loop.shutdown()


def engine_launch_kwargs(config, process: bool = True) -> dict:
    """``engine_factory``/``process``/``tokenizer_factory`` keywords of ``make_server`` and
    ``BackgroundServer`` for an ``EngineConfig`` (picklable factories, so either mode works)."""
    from kvfit.engine.llm_engine import LLMEngine
    from kvfit.server.engine_process import tokenizer_for

    return {"engine_factory": functools.partial(LLMEngine, config), "process": process,
            "tokenizer_factory": functools.partial(tokenizer_for, config) if process else None}


def make_server(engine_factory: Callable[[], object], served_model_name: str, host: str,
                port: int, log_level: str = "info", aliases=(), process: bool = False,
                tokenizer_factory: Optional[Callable[[], object]] = None) -> KvfitUvicorn:
    """Start the engine (the model loads while uvicorn binds; /health is 503 until it is
    ready) and return the uvicorn server, not yet running. ``process``: the engine runs in its
    own process (``engine_factory`` picklable; see ``engine_loop``), else in a thread."""
    holder: list[KvfitUvicorn] = []

    def stop_server() -> None:  # an engine that cannot start ends the server (exit code 1)
        if holder:
            holder[0].should_exit = True

    loop = EngineLoop(engine_factory, on_start_failure=stop_server, process=process,
                      tokenizer_factory=tokenizer_factory)
    app = build_app(loop, served_model_name, aliases)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=10, lifespan="off")
    holder.append(KvfitUvicorn(config, loop))
    uv_log = logging.getLogger("uvicorn.error")
    for f in [f for f in uv_log.filters if isinstance(f, StartingNote)]:
        uv_log.removeFilter(f)  # one note, for the newest server
    uv_log.addFilter(StartingNote(loop))
    loop.start()
    return holder[0]


class BackgroundServer:
    """A server in a daemon thread on a free loopback port; ``with`` starts and stops it.
    ``process``/``tokenizer_factory``: as in ``make_server``."""

    def __init__(self, engine_factory: Callable[[], object], served_model_name: str,
                 host: str = "127.0.0.1", port: Optional[int] = None, log_level: str = "warning",
                 aliases=(), process: bool = False,
                 tokenizer_factory: Optional[Callable[[], object]] = None):
        self.host, self.port = host, port or free_port(host)
        self.server = make_server(engine_factory, served_model_name, self.host, self.port,
                                  log_level, aliases, process, tokenizer_factory)
        self.engine_loop = self.server.engine_loop
        self._thread: Optional[threading.Thread] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> "BackgroundServer":
        """Run uvicorn in a thread; return once /health answers 200 (the engine is up)."""
        import httpx

        self._thread = threading.Thread(target=self.server.run, name="kvfit-uvicorn",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine_loop.state == "dead":
                self.stop()
                raise RuntimeError(f"engine failed to start: {self.engine_loop.error}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server did not become healthy within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine_loop.shutdown()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve_child(config, served_model_name: str, port: int, log_level: str,
                 engine_factory: Optional[Callable[[], object]] = None) -> None:
    """A server process's main: uvicorn here, the engine in a process of its own (built by
    ``engine_factory`` when given, e.g. an engine with a step timer, else from ``config``)."""
    import logging

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_launch_kwargs(config, True)
    if engine_factory is not None:
        kwargs["engine_factory"] = engine_factory
    server = make_server(served_model_name=served_model_name, host="127.0.0.1", port=port,
                         log_level=log_level, aliases=(config.model,), **kwargs)
    try:
        server.run()
    finally:
        server.engine_loop.shutdown()


class ServerProcess:
    """``kvfit serve`` for an ``EngineConfig`` in a child process on a free loopback port (so a
    load generator in this process shares no GIL with it); ``with`` starts and stops it.
    ``engine_factory``: a picklable builder of the engine instead of the config's (benchmarks:
    ``kvfit.bench.step_timer.timed_engine``)."""

    def __init__(self, config, served_model_name: str, log_level: str = "warning",
                 engine_factory: Optional[Callable[[], object]] = None):
        import multiprocessing as mp

        self.host, self.port = "127.0.0.1", free_port()
        # NOTE: not a daemon: a daemonic process may not start the engine process it needs
        self._proc = mp.get_context("spawn").Process(
            target=_serve_child, name="kvfit-server",
            args=(config, served_model_name, self.port, log_level, engine_factory))

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 600.0) -> "ServerProcess":
        """Start it; return once /health answers 200 (the engine is up)."""
        import httpx

        self._proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._proc.is_alive():
                raise RuntimeError(f"the server process exited (code {self._proc.exitcode}); "
                                   "its log is above")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server did not become healthy within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (graceful: in-flight requests aborted, the engine process stopped)."""
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
