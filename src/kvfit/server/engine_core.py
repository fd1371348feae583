"""The engine core: the loop that owns one ``LLMEngine`` and only steps it and hands out raw
results, one message per step. It runs in the server's engine process (default) or in a thread
of the server process (``EngineLoop`` with a plain factory: tests, fakes); ``engine_loop`` turns
its messages into per-request events on the HTTP side.

Messages out (``emit(events, stats)``, once per loop iteration, never per token): ``events`` is a
list of tuples
- ``("accepted", rid)``, ``("rejected", rid, status, message, param)``,
- ``("out", rid, new_ids, text_offset, text_piece, new_logprobs, prompt_logprobs, finish,
  num_cached_tokens, queue_seconds)``:
  what one step added to one request (``queue_seconds``: with the finish, the request's time
  from arrival to its first step, ``RequestMetrics.time_in_queue``; else None). Text travels as a piece appended at ``text_offset`` of the
  text already sent (the engine's text only grows, except when a stop string cuts its tail: then
  the offset is smaller), so no cumulative copies cross per step; logprob dicts only for
  requests that asked for them.
Commands in: ``("add", rid, prompt, params)``, ``("abort", rid)``, ``("abort_all",)``,
``("stop",)``. The loop drains every pending command between steps, so an abort frees the
request's pages before the next step runs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvfit.errors import (KVBudgetError, ModelNotFoundError, RequestRejected,
                          UnsupportedCombinationError)

# start-up failures that are the user's to fix (reported as such, not as engine crashes)
USER_ERRORS = (ModelNotFoundError, UnsupportedCombinationError, KVBudgetError, ValueError)

logger = logging.getLogger("kvfit.server")


class _Sent:
    """How much of one request's output the HTTP side already has."""

    __slots__ = ("text", "prompt_logprobs")

    def __init__(self):
        self.text, self.prompt_logprobs = 0, False


class CoreLoop:
    """Steps ``engine`` until a ``stop`` command arrives; ``get_commands(block)`` returns the
    pending commands (waiting a while for one when ``block``) or None once the command source is
    gone; ``emit(events, stats)`` sends one message. Mutates the engine only."""

    def __init__(self, engine: Any, get_commands: Callable[[bool], Any],
                 emit: Callable[[list, dict], None]):
        self.engine, self._get, self._emit = engine, get_commands, emit
        self._sent: dict[str, _Sent] = {}

    def run(self) -> None:
        """Returns on ``stop`` (every request aborted first); exceptions propagate."""
        eng = self.engine
        try:
            while True:
                events: list = []
                cmds = self._get(not eng.has_unfinished_requests())
                if cmds is None or not self._apply(cmds, events):
                    break
                if eng.has_unfinished_requests():
                    self._collect(eng.step(delta=True), events)
                if events or cmds:
                    # NOTE: stats go with the events: a client that saw its request finish then
                    # reads /metrics with that request's pages already counted free.
                    self._emit(events, eng.stats())
        finally:
            for rid in list(self._sent):
                eng.abort_request(rid)
            self._sent.clear()

    def _apply(self, cmds, events: list) -> bool:
        """Run the commands; False once ``stop`` arrives."""
        for cmd in cmds:
            op = cmd[0]
            if op == "stop":
                return False
            if op == "add":
                self._add(*cmd[1:], events=events)
            elif op == "abort":
                if self._sent.pop(cmd[1], None) is not None:
                    self.engine.abort_request(cmd[1])
            elif op == "abort_all":
                for rid in list(self._sent):
                    self.engine.abort_request(rid)
                self._sent.clear()
        return True

    def _add(self, rid: str, prompt, params, events: list) -> None:
        if rid in self._sent:
            events.append(("rejected", rid, 400, f"duplicate request id {rid}", None))
            return
        try:
            self.engine.add_request(rid, prompt, params)
        except RequestRejected as e:
            events.append(("rejected", rid, 400, str(e), e.param))
            return
        except (ValueError, TypeError) as e:
            events.append(("rejected", rid, 400, str(e), None))
            return
        except Exception as e:  # noqa: BLE001 - an engine bug hit by one request: answer it,
            # keep serving the others (add_request validates before it mutates anything)
            logger.exception("add_request failed for %s", rid)
            events.append(("rejected", rid, 500, f"internal error ({type(e).__name__})", None))
            return
        self._sent[rid] = _Sent()
        events.append(("accepted", rid))

    def _collect(self, outputs, events: list) -> None:
        for out in outputs:
            sent = self._sent.get(out.request_id)
            if sent is None:
                continue  # aborted meanwhile
            comp = out.outputs[0]  # a delta: the ids and logprobs this step added
            new_ids = comp.token_ids
            lps = comp.logprobs
            text = comp.text
            offset = sent.text if len(text) >= sent.text else 0
            piece = text[offset:]
            plp = None
            if out.prompt_logprobs is not None and not sent.prompt_logprobs:
                plp, sent.prompt_logprobs = out.prompt_logprobs, True
            sent.text = len(text)
            finish = comp.finish_reason
            queue_s = None
            if out.finished or finish is not None:
                finish = finish or "stop"
                del self._sent[out.request_id]
                metrics = getattr(out, "metrics", None)
                queue_s = metrics.time_in_queue if metrics is not None else None
            events.append(("out", out.request_id, new_ids, offset, piece, lps, plp, finish,
                           getattr(out, "num_cached_tokens", 0), queue_s))
