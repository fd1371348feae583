"""The engine thread: the one owner of an ``LLMEngine`` inside the server.

Why a thread (and not the event loop, nor a process):
- ``LLMEngine`` is not thread-safe and ``step()`` blocks for a whole forward pass. Run on the
  asyncio loop it would freeze every HTTP connection for that time; so it runs elsewhere, and
  only one thread ever calls it.
- A thread rather than a process (vLLM's engine-core process): torch releases the GIL inside its
  kernels (CPU and CUDA launches), the HTTP side is light, and in-process we need no IPC, no
  serialization of outputs and no second copy of the tokenizer or CUDA context. The price is some
  GIL sharing between scheduling code and the event loop, small at this engine's scale.

Protocol: handlers call ``add`` / ``abort`` (thread-safe: commands go through a ``SimpleQueue``);
the thread drains commands between steps, runs ``engine.step()`` while there is work, and pushes
events to each request's asyncio queue with ``loop.call_soon_threadsafe``. Events are tuples
``(index, kind, payload)`` with kind ``accepted`` (payload None), ``output`` (a ``Delta``) or
``error`` (an ``APIError``). If the loop dies, every in-flight request gets an ``error`` event,
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

from kvfit.errors import (KVBudgetError, ModelNotFoundError, RequestRejected,
                          UnsupportedCombinationError)
from kvfit.server.errors import APIError
from kvfit.server.metrics import ServerMetrics

logger = logging.getLogger("kvfit.server")

_USER_ERRORS = (ModelNotFoundError, UnsupportedCombinationError, KVBudgetError, ValueError)


@dataclass
class Delta:
    """What one step changed for one engine request (built in the engine thread, so the HTTP
    side never reads engine-owned lists while they grow). ``text`` is the cumulative text;
    ``prompt_logprobs`` (echo) comes with the first delta of a request only."""

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
    sent_prompt_logprobs: bool = False

    def push(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, kind, payload))
        except RuntimeError:  # the event loop is closed (server shut down): nobody listens
            pass


def _put_all(items: list) -> None:
    """Runs on the event loop: deliver one step's events."""
    for q, item in items:
        q.put_nowait(item)


def unavailable(msg: str) -> APIError:
    return APIError(503, msg, code="engine_unavailable")


class EngineLoop:
    """Runs ``factory()`` (building the engine, e.g. loading weights) and then the step loop in a
    daemon thread. ``state`` is ``starting`` → ``ready`` → ``stopped`` | ``dead``."""

    def __init__(self, factory: Callable[[], Any],
                 on_start_failure: Optional[Callable[[], None]] = None):
        self._factory, self._on_start_failure = factory, on_start_failure
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders add() against death/stop: no command is stranded
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stats: Optional[dict] = None
        self.state = "starting"
        self.error: Optional[str] = None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.max_model_len: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self.metrics = ServerMetrics(lambda: self._stats, lambda: self.state == "ready")

    # ---- called from any thread -----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="kvfit-engine", daemon=True)
        self._thread.start()
        return self

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
            self._cmds.put(("add", request_id, prompt, params, stream))

    def abort(self, request_id: str, disconnected: bool = True) -> None:
        """Abort a request (its pages are freed by the engine thread at its next command drain)."""
        self._cmds.put(("abort", request_id, disconnected))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; each gets a 503 error event saying ``reason``."""
        self._cmds.put(("abort_all", reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: in-flight requests are aborted (503 events), the thread exits."""
        with self._lock:
            if self.state in ("starting", "ready"):
                self.state = "stopping"
        self._cmds.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            eng = self._factory()
            self.engine, self.tokenizer = eng, eng.tokenizer
            self.max_model_len = eng.max_model_len
            self.vocab_size = eng.vocab_size
            self._stats = dict(eng.stats())
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            if isinstance(e, _USER_ERRORS):  # a message naming the fix; no traceback needed
                logger.error("engine failed to start: %s", e)
            else:
                logger.exception("engine failed to start")
            self._die(f"engine failed to start: {type(e).__name__}: {e}")
            self._ready.set()
            if self._on_start_failure is not None:
                self._on_start_failure()
            return
        with self._lock:
            if self.state == "starting":
                self.state = "ready"
        self._ready.set()
        logger.info("engine ready (max_model_len=%s)", self.max_model_len)
        try:
            while True:
                busy = eng.has_unfinished_requests()
                if not self._drain(eng, block=not busy):
                    break
                outputs = eng.step() if eng.has_unfinished_requests() else []
                # NOTE: stats before events: a client that saw its request finish then reads
                # /metrics with that request's pages already counted free.
                self._stats = dict(eng.stats())
                if outputs:
                    self._dispatch(outputs)
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine loop died")
            self._die(f"{type(e).__name__}: {e}")
            return
        self._abort_everything(eng, "the server is shutting down")
        self._stats = dict(eng.stats())
        with self._lock:
            self.state = "stopped"
            self._fail_pending(unavailable("the server is shutting down"))

    def _drain(self, eng, block: bool) -> bool:
        """Apply queued commands; False once a stop command arrives."""
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return self.state in ("ready", "starting")
        while True:
            op = cmd[0]
            if op == "stop":
                return False
            if op == "add":
                self._add(eng, *cmd[1:])
            elif op == "abort":
                self._abort(eng, cmd[1], cmd[2])
            elif op == "abort_all":
                self._abort_everything(eng, cmd[1])
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, eng, rid: str, prompt, params, stream: _Stream) -> None:
        if rid in self._streams:
            stream.push("error", APIError(400, f"duplicate request id {rid}"))
            return
        try:
            eng.add_request(rid, prompt, params)
        except RequestRejected as e:
            stream.push("error", APIError(400, str(e), param=e.param))
            return
        except (ValueError, TypeError) as e:
            stream.push("error", APIError(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - an engine bug hit by one request: answer it,
            # keep serving the others (add_request validates before it mutates anything)
            logger.exception("add_request failed for %s", rid)
            stream.push("error", APIError(500, f"internal error ({type(e).__name__})"))
            return
        self._streams[rid] = stream
        stream.push("accepted", None)

    def _abort(self, eng, rid: str, disconnected: bool) -> None:
        if self._streams.pop(rid, None) is None:
            return  # already finished
        eng.abort_request(rid)
        if disconnected:
            self.metrics.disconnects.inc()
        self.metrics.finished.labels("abort").inc()

    def _abort_everything(self, eng, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            eng.abort_request(rid)
            self.metrics.finished.labels("abort").inc()
            stream.push("error", unavailable(reason))
        self._streams.clear()

    def _dispatch(self, outputs) -> None:
        """Turn a step's outputs into Deltas; one wake-up per event loop per step (not one per
        request: at large batch sizes per-request wake-ups would cost more than the step)."""
        now = time.monotonic()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            comp = out.outputs[0]
            n_new = len(comp.token_ids) - stream.num_tokens
            if n_new > 0:
                if stream.last_token_time is None:
                    m.ttft.observe(now - stream.arrival)
                    for _ in range(n_new - 1):
                        m.itl.observe(0.0)
                else:
                    gap = (now - stream.last_token_time) / n_new
                    for _ in range(n_new):
                        m.itl.observe(gap)
                stream.last_token_time = now
            new_ids = list(comp.token_ids[stream.num_tokens:])
            new_lps = list(comp.logprobs[stream.num_tokens:]) if comp.logprobs else None
            plp = None
            if out.prompt_logprobs is not None and not stream.sent_prompt_logprobs:
                plp, stream.sent_prompt_logprobs = list(out.prompt_logprobs), True
            stream.num_tokens = len(comp.token_ids)
            batches.setdefault(stream.loop, []).append((stream.queue, (
                stream.index, "output", Delta(comp.text, new_ids, new_lps, stream.num_tokens,
                                              comp.finish_reason, plp,
                                              getattr(out, "num_cached_tokens", 0)))))
            if out.finished or comp.finish_reason is not None:
                self._streams.pop(out.request_id, None)
                m.finished.labels(comp.finish_reason or "stop").inc()
                m.e2e.observe(now - stream.arrival)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody listens any more
                pass

    def _fail_pending(self, err: APIError) -> None:
        """Answer commands nobody will execute (call with ``_lock`` held)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[4].push("error", err)

    def _die(self, msg: str) -> None:
        err = unavailable(f"the engine loop died: {msg}")
        with self._lock:
            self.state, self.error = "dead", msg
            for stream in self._streams.values():
                stream.push("error", err)
            self._streams.clear()
            self._fail_pending(err)
