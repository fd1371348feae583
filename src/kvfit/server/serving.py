"""One HTTP request's life on the event loop: n engine requests submitted to the engine thread,
their events gathered from one asyncio queue, aborts when the client leaves.

``Submission`` owns the engine request ids of one HTTP request: ``start`` waits until the engine
accepted every one (so a rejected request is a 400 before any stream starts), ``events`` yields
``(index, Delta)`` until every choice finished, and ``close`` aborts what is unfinished
(``disconnected=True`` counts a client disconnect in /metrics).

NOTE: a handler that fell ``MERGE_BACKLOG`` or more steps behind the engine (the event loop
overloaded by other streams) finds that many Deltas waiting; ``events`` merges them into one
(vLLM's output collector does the same), so one SSE chunk and one socket write carry them all
and an overloaded server catches up instead of falling further behind. Below that backlog (the
jitter of a busy loop) every step's tokens stay a chunk of their own.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional

from fastapi import Request

from kvfit.server.engine_loop import Delta, EngineLoop
from kvfit.server.errors import APIError
from kvfit.server.protocol import random_id

_POLL_S = 0.5  # how often a waiting non-streaming handler checks the client and the engine
# Waiting events from which a lagging stream's Deltas merge into one chunk: 32 steps is ~0.2 s
# behind on the H200, an overload valve only (below it one chunk per step, always).
MERGE_BACKLOG = 32


class Submission:
    """``jobs``: one ``(prompt_token_ids, SamplingParams)`` per choice index."""

    def __init__(self, loop: EngineLoop, jobs: list, raw: Optional[Request] = None):
        self.loop, self.jobs, self.raw = loop, jobs, raw
        base = random_id("req")
        self.ids = [f"{base}-{i}" for i in range(len(jobs))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(range(len(jobs)))
        self._buffer: list = []
        self._next_check = time.monotonic() + _POLL_S

    async def start(self) -> None:
        """Submit all choices and wait for the engine thread's verdict on each (APIError if any
        was rejected; the accepted ones are aborted then)."""
        accepted: set[int] = set()  # choice indexes the engine thread took
        try:
            for i, ((ids, params), rid) in enumerate(zip(self.jobs, self.ids)):
                self.loop.add(rid, ids, params, self.queue, i)
            while len(accepted) < len(self.jobs):
                index, kind, payload = await self._get(poll_client=True)
                if kind == "accepted":
                    accepted.add(index)
                elif kind == "error":
                    raise payload
                else:
                    self._buffer.append((index, kind, payload))
        except BaseException as e:
            # Abort every id, accepted or not: commands run in order, so an abort queued after
            # an add still finds (and frees) that request; unknown ids are ignored.
            gone = isinstance(e, (ClientGone, asyncio.CancelledError))
            for rid in self.ids:
                self.loop.abort(rid, disconnected=gone)
            self.unfinished.clear()
            raise

    async def events(self, poll_client: bool) -> AsyncIterator[tuple[int, Delta]]:
        """Yield (index, Delta) until every choice finished; raise APIError on an engine error.

        ``poll_client``: check ``request.is_disconnected()`` while waiting (non-streaming only;
        a streaming response is cancelled by Starlette instead)."""
        while self.unfinished:
            if self._buffer:
                index, kind, payload = self._buffer.pop(0)
            else:
                index, kind, payload = await self._get(poll_client)
                if kind == "output" and self.queue.qsize() >= MERGE_BACKLOG:
                    payload = self._merge_waiting(index, payload)
            if kind == "error":
                self.unfinished.discard(index)
                raise payload
            if kind != "output":
                continue
            if payload.finish_reason is not None:
                self.unfinished.discard(index)
            yield index, payload

    def _merge_waiting(self, index: int, delta: Delta) -> Delta:
        """Fold the Deltas of choice ``index`` already waiting right behind ``delta`` into it."""
        while delta.finish_reason is None and not self.queue.empty():
            item = self.queue.get_nowait()
            if item[0] != index or item[1] != "output":
                self._buffer.append(item)
                break
            delta = merge_deltas(delta, item[2])
        return delta

    async def _get(self, poll_client: bool):
        # NOTE: the client is checked every _POLL_S whether or not events keep arriving (a busy
        # request never goes idle long enough for an idle-time check).
        if not poll_client:
            # Streaming (Starlette cancels the stream when the client leaves): no clock and no
            # timer per token. The wait cannot hang: the engine loop answers every registered
            # stream when it dies or stops (``EngineLoop._fail_all``), and a stream is
            # registered before its first wait.
            if self.queue.empty() and self.loop.state in ("dead", "stopped"):
                raise self.loop.unavailable_error()
            return await self.queue.get()
        while True:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _POLL_S
                if self.loop.state in ("dead", "stopped") and self.queue.empty():
                    # The engine thread answers every request when it dies or stops; this is
                    # the belt to those braces: never wait forever on a loop that is gone.
                    raise self.loop.unavailable_error()
                if poll_client and self.raw is not None and await self.raw.is_disconnected():
                    raise ClientGone()
            if not self.queue.empty():  # fast path: no timer task when an event is waiting
                return self.queue.get_nowait()
            try:  # NOTE: asyncio.timeout, not wait_for: no extra Task per wait (per step)
                async with asyncio.timeout(max(self._next_check - now, 0.01)):
                    return await self.queue.get()
            except TimeoutError:
                pass

    def close(self, disconnected: bool) -> None:
        """Abort every unfinished choice (pages freed by the engine thread right away)."""
        for i in sorted(self.unfinished):
            self.loop.abort(self.ids[i], disconnected=disconnected)
        self.unfinished.clear()


def merge_deltas(first: Delta, then: Delta) -> Delta:
    """One Delta saying what ``first`` and then ``then`` (of the same request) said."""
    lps = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        lps = (first.new_logprobs or []) + (then.new_logprobs or [])
    plp = first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs
    return Delta(then.text, first.new_token_ids + then.new_token_ids, lps, then.num_tokens,
                 then.finish_reason, plp, then.num_cached_tokens)


class ClientGone(APIError):
    """The client disconnected while its request waited (499, nginx's code: nobody reads it)."""

    def __init__(self):
        super().__init__(499, "client disconnected")


async def gather(sub: Submission) -> list[list[Delta]]:
    """Non-streaming: every Delta per choice, until all finished (aborts if the client leaves)."""
    per_choice: list[list[Delta]] = [[] for _ in sub.jobs]
    try:
        async for index, delta in sub.events(poll_client=True):
            per_choice[index].append(delta)
    except BaseException as e:
        sub.close(disconnected=isinstance(e, (ClientGone, asyncio.CancelledError)))
        raise
    return per_choice


def ensure_serving(loop: EngineLoop) -> None:
    if not loop.alive:
        raise loop.unavailable_error()

