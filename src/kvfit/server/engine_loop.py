"""The server's side of the engine: ``EngineLoop`` hands requests to the engine core
(``engine_core.CoreLoop``) and turns its one-message-per-step output into per-request events on
each request's asyncio queue.

Where the engine runs (``process=True``, what ``kvfit serve`` and ``kvfit bench serve`` use):
in its own process, as vLLM's and SGLang's engine cores do. Measured reasons, not taste:
- The engine's step is host-bound Python (scheduling, metadata, kernel launches). In one process
  it shares the GIL with uvicorn, JSON/SSE framing and (in ``bench serve``) the load generator:
  every token costs the HTTP side tens of microseconds of GIL, and a thread that gave the GIL up
  (a CUDA sync, a socket wait) waits up to ``sys.getswitchinterval()`` (5 ms) to get it back from
  a busy event loop. On the H200 that kept 43% (fp8) / 36% (bf16) of the offline throughput at
  concurrency 64 (with the load generator in the same process; docs/benchmarks.md).
- In its own process the engine never waits for the GIL; what crosses the socket is one pickled
  message per step (new token ids, a text piece, logprobs only when asked), a few KB, while the
  Deltas, SSE framing and HTTP run on the server's side, all on uvicorn's event loop (no extra
  thread in the server process: see ``engine_process``).
- Costs: a second process start (imports, ~1-3 s), a tokenizer loaded on both sides, and the
  engine object is not reachable from the server process (``engine`` is None).
- Stop strings and detokenization stay in the engine (they decide when a request finishes);
  the engine's step overlap (issue 13, deliverable 2) hides them behind the GPU.
Measured on the H200 (Qwen3-1.7B shape, fp8 KV, 256 x 1,024 in / 256 out, concurrency 64):
the thread kept 43% of the offline output throughput; the process with a receiver/sender
thread pair in the server 74-76% (decode TPOT equal to offline's step time; the loss was time
to first token, the server process at ~90% CPU). A CPU profile then showed those threads' GIL
hand-offs stalling the event loop ~4 ms per request, hence no threads now; this version's GPU
figure is still to be taken (docs/benchmarks.md).
``process=False`` runs the same core in a daemon thread of this process (``factory`` may then be
any callable, e.g. a closure: tests inject faults through ``engine``).

Protocol: handlers call ``add`` / ``abort`` (thread-safe: commands go to the engine thread's
``SimpleQueue``, or in process mode straight into the socket). Events reach a request's queue as
``(index, kind, payload)`` with kind ``accepted`` (payload None), ``output`` (a ``Delta``) or
``error`` (an ``APIError``), one wake-up per event loop per step (``call_soon_threadsafe`` from
the engine thread; in process mode the server's loop reads the step itself). If the engine
dies (an exception, or its process exits), every in-flight request gets an ``error`` event,
``alive`` turns False (``/health`` says 503) and later ``add`` calls raise at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvfit.errors import WorkerLostError
from kvfit.server.errors import APIError
from kvfit.server.metrics import ServerMetrics

logger = logging.getLogger("kvfit.server")



@dataclass
class Delta:
    """What one step changed for one engine request (built on the server side from the core's
    message). ``text`` is the cumulative text; ``prompt_logprobs`` (echo) comes with the first
    delta of a request only."""

    text: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, float]]]
    num_tokens: int
    finish_reason: Optional[str]
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: Optional[float] = None
    num_tokens: int = 0
    text: str = ""


def _put_all(items: list) -> None:
    """Runs on the event loop: deliver one step's events."""
    for q, item in items:
        q.put_nowait(item)


def _post(batches: dict) -> None:
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for loop, items in batches.items():
        if loop is here:  # process mode: we are on the server's loop already
            _put_all(items)
            continue
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: nobody listens any more
            pass


def unavailable(msg: str) -> APIError:
    return APIError(503, msg, code="engine_unavailable")


_FATAL = WorkerLostError.__name__  # deaths that end the server (a message starts with it)


class EngineLoop:
    """Starts the engine core (``factory()`` builds the engine, e.g. loading weights) in a daemon
    thread, or with ``process=True`` in a child process (``factory`` must then be picklable, e.g.
    ``functools.partial(LLMEngine, config)``, ``tokenizer_factory`` gives this side its
    tokenizer, and ``attach`` must be called from the server's event loop). ``state`` is
    ``starting`` → ``ready`` → ``stopped`` | ``dead``."""

    def __init__(self, factory: Callable[[], Any],
                 on_start_failure: Optional[Callable[[], None]] = None, process: bool = False,
                 tokenizer_factory: Optional[Callable[[], Any]] = None):
        self._factory, self._on_start_failure = factory, on_start_failure
        self._process_mode, self._tokenizer_factory = process, tokenizer_factory
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders add() against death/stop: no request is stranded
        self._streams: dict[str, _Stream] = {}  # requests the HTTP side waits on
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None  # thread mode
        self._channel: Any = None  # process mode: engine_process.Channel
        self._submit: Callable[[tuple], None] = self._cmds.put
        self._stats: Optional[dict] = None
        self.state = "starting"
        self.error: Optional[str] = None
        self.engine: Any = None  # the engine object (thread mode only)
        self.tokenizer: Any = None
        self.max_model_len: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self.metrics = ServerMetrics(lambda: self._stats, lambda: self.state == "ready")

    # ---- called from any thread -----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    def start(self) -> "EngineLoop":
        if self._process_mode:
            from kvfit.server.engine_process import start_engine_process

            self._channel = start_engine_process(self)
            self._submit = self._channel.submit
        else:
            self._thread = threading.Thread(target=self._run_thread, name="kvfit-engine",
                                            daemon=True)
            self._thread.start()
        return self

    def attach(self, aio: asyncio.AbstractEventLoop) -> None:
        """Process mode: serve the engine's socket on ``aio`` (the server's loop, from its
        thread; until then the engine's messages wait in the socket). No-op in thread mode."""
        if self._channel is not None:
            self._channel.attach(aio)

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """True once the engine is up; False on timeout or if it failed to start."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def stats(self) -> Optional[dict]:
        return self._stats

    def unavailable_error(self) -> APIError:
        if self.state == "starting":
            return unavailable("the engine is starting; retry shortly")
        if self.state == "dead":
            return unavailable(f"the engine loop died: {self.error}")
        return unavailable("the server is shutting down")

    def add(self, request_id: str, prompt: Any, params: Any, q: asyncio.Queue, index: int = 0,
            loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Queue a request; its events arrive on ``q``. Raises APIError(503) if not serving."""
        stream = _Stream(loop or asyncio.get_running_loop(), q, index)
        with self._lock:
            if self.state != "ready":
                raise self.unavailable_error()
            if request_id in self._streams:
                _post({stream.loop: [(q, (index, "error", APIError(
                    400, f"duplicate request id {request_id}")))]})
                return
            self._streams[request_id] = stream
            self._submit(("add", request_id, prompt, params))

    def abort(self, request_id: str, disconnected: bool = True) -> None:
        """Abort a request (the engine frees its pages before its next step)."""
        if self._streams.pop(request_id, None) is not None:
            if disconnected:
                self.metrics.disconnects.inc()
            self.metrics.finished.labels("abort").inc()
        self._submit(("abort", request_id))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; each gets a 503 error event saying ``reason``."""
        with self._lock:
            self._fail_all(unavailable(reason), count_abort=True)
            self._submit(("abort_all",))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: in-flight requests are aborted (503 events), the core exits."""
        with self._lock:
            if self.state in ("starting", "ready"):
                self.state = "stopping"
        if self._channel is not None:
            self._channel.stop(timeout)
        else:
            self._cmds.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._finish_stopped()

    # ---- the core's side (the engine thread, or in process mode the server's event loop) ----

    def _get_commands(self, block: bool) -> list:
        try:
            cmds = [self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _run_thread(self) -> None:
        from kvfit.server.engine_core import USER_ERRORS, CoreLoop

        try:
            eng = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            self._start_failed(f"{type(e).__name__}: {e}", isinstance(e, USER_ERRORS), e)
            return
        self.engine = eng
        self._mark_ready(eng.tokenizer, eng.max_model_len, eng.vocab_size, dict(eng.stats()))
        try:
            CoreLoop(eng, self._get_commands, self._deliver).run()
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine loop died")
            self._die(f"{type(e).__name__}: {e}")
            return
        self._stats = dict(eng.stats())
        self._finish_stopped()

    def _mark_ready(self, tokenizer, max_model_len: int, vocab_size: int, stats: dict) -> None:
        self.tokenizer, self.max_model_len, self._stats = tokenizer, max_model_len, stats
        self.vocab_size = vocab_size
        with self._lock:
            if self.state == "starting":
                self.state = "ready"
        self._ready.set()
        logger.info("engine ready: serving requests (max_model_len=%s); /health answers 200",
                    self.max_model_len)

    def _start_failed(self, msg: str, user_error: bool, exc: Optional[BaseException]) -> None:
        if user_error or exc is None:  # a message naming the fix; no traceback needed
            logger.error("engine failed to start: %s", msg)
        else:
            logger.error("engine failed to start", exc_info=exc)
        self._die(f"engine failed to start: {msg}")
        self._ready.set()
        if self._on_start_failure is not None:
            self._on_start_failure()

    def _deliver(self, events: list, stats: dict) -> None:
        """One core message → Deltas and metrics; one wake-up per event loop."""
        self._stats = stats
        now = time.monotonic()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for ev in events:
            rid = ev[1]
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted or failed meanwhile
            kind = ev[0]
            if kind == "accepted":
                item = (stream.index, "accepted", None)
            elif kind == "rejected":
                self._streams.pop(rid, None)
                item = (stream.index, "error", APIError(ev[2], ev[3], param=ev[4]))
            else:
                _, _, new_ids, offset, piece, lps, plp, finish, cached, queue_s = ev
                n_new = len(new_ids)
                if n_new:
                    if stream.last_token_time is None:
                        m.ttft.observe(now - stream.arrival)
                        if n_new > 1:
                            m.itl.observe(0.0, n_new - 1)
                    else:
                        m.itl.observe((now - stream.last_token_time) / n_new, n_new)
                    stream.last_token_time = now
                if piece or offset != len(stream.text):
                    stream.text = stream.text[:offset] + piece
                stream.num_tokens += n_new
                item = (stream.index, "output", Delta(stream.text, new_ids, lps,
                                                      stream.num_tokens, finish, plp, cached))
                if finish is not None:
                    self._streams.pop(rid, None)
                    m.finished.labels(finish).inc()
                    m.e2e.observe(now - stream.arrival)
                    if queue_s is not None:
                        m.queue_time.observe(queue_s)
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        _post(batches)

    def _fail_all(self, err: APIError, count_abort: bool = False) -> None:
        """Answer every waiting request with ``err`` (call with ``_lock`` held)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in self._streams.values():
            if count_abort:
                self.metrics.finished.labels("abort").inc()
            batches.setdefault(stream.loop, []).append((stream.queue,
                                                        (stream.index, "error", err)))
        self._streams.clear()
        _post(batches)

    def _finish_stopped(self) -> None:
        with self._lock:
            if self.state != "dead":
                self.state = "stopped"
            self._fail_all(unavailable("the server is shutting down"))
        self._ready.set()

    def _engine_gone(self, proc) -> None:
        """Process mode: the engine's socket closed."""
        proc.join(1.0)
        if self.state in ("starting", "ready"):
            msg = f"the engine process exited unexpectedly (exit code {proc.exitcode})"
            if self.state == "starting":
                self._start_failed(msg, False, None)
            else:
                logger.error(msg)
                self._die(msg)
        else:
            self._finish_stopped()

    def _die(self, msg: str) -> None:
        with self._lock:
            self.state, self.error = "dead", msg
            self._fail_all(unavailable(f"the engine loop died: {msg}"))
        if msg.startswith(_FATAL) and self._on_start_failure is not None:
            # a lost tensor-parallel worker cannot come back: after answering everyone (503),
            # the server stops and exits non-zero so that a supervisor restarts it
            logger.error("stopping the server: %s", msg)
            self._on_start_failure()
