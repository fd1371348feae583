"""Request: one sequence's state from admission to finish (tokens, pages, sampling state)."""

from __future__ import annotations

import enum
import time
from array import array
from typing import Optional

from kvfit.sampling_params import SamplingParams


PLACEHOLDER = -1  # an output token sampled on the device whose id the host has not read yet


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Owns its token lists, its page list (the per-request page table) and its sampling seed.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. A request is in prefill
    while ``num_computed_tokens < num_tokens - 1``; it samples when a step's chunk reaches its
    last token. Preemption by recompute resets ``num_computed_tokens`` to 0 and drops the pages;
    output tokens are kept, so the recomputed prefill covers prompt + outputs.

    Overlap scheduling: when a step that samples for this request is launched, a placeholder
    (``PLACEHOLDER``) is appended to ``output_token_ids`` and ``num_pending`` counts it; the next
    step reads that token from the launched step's device ids (row ``pending_row``) and the
    engine overwrites the placeholder once the step's ids reach the host.
    """

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, sampling_seed: int, arrival: int,
                 prompt_int64: Optional[memoryview] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        # the token at position p is drawn from uniform(sampling_seed, p): see engine.sampling
        self.sampling_seed = sampling_seed
        self.arrival = arrival
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing placeholders in output_token_ids (launched, not read)
        self.num_output_emitted = 0  # output tokens already handed out as deltas (server)
        self.pending_row = -1  # row of the newest placeholder in its step's sampled ids
        self.pages: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.logprobs: Optional[list[dict[int, float]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = (
            [None] if params.prompt_logprobs is not None else None)
        self.text = ""
        self.detok = None  # IncrementalDetokenizer, set by the engine
        self.grammar = None  # xgrammar GrammarMatcher of a structured request, set by the engine
        self.num_preemptions = 0
        # prefix caching (scheduler-owned): keys of this request's full pages, the root they were
        # chained from, how many of its pages are registered, prompt tokens found cached
        self.page_keys: list[bytes] = []
        self.page_keys_root: Optional[bytes] = None
        self.num_registered_pages = 0
        self.num_cached_tokens: Optional[int] = None  # set at first admission
        # int64 bytes of the prompt (page keys): given (``request_check.prompt_ids``) or made
        # on first use
        self._prompt_bytes: Optional[memoryview] = prompt_int64
        # RequestOutput.metrics (monotonic seconds): arrival, first admitted into a step, first
        # and latest output token, finished
        self.t_arrival = time.monotonic()
        self.t_first_scheduled: Optional[float] = None
        self.t_first_token: Optional[float] = None
        self.t_last_token: Optional[float] = None
        self.t_finished: Optional[float] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_confirmed(self) -> int:
        """Output tokens whose ids the host has read (placeholders excluded)."""
        return len(self.output_token_ids) - self.num_pending

    def length_capped(self) -> bool:
        """True when launched steps already produce its last allowed token (max_tokens): it
        needs no further step, only the pending ids."""
        return self.num_pending > 0 and len(self.output_token_ids) >= self.params.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_slice_bytes(self, start: int, end: int) -> bytes | memoryview:
        """``token_slice`` as int64 bytes (native order; prefix-cache page keys). The prompt's
        bytes are converted once per request and sliced as a view afterwards."""
        p = self.num_prompt_tokens
        if end <= p:
            if self._prompt_bytes is None:
                self._prompt_bytes = memoryview(array("q", self.prompt_token_ids).tobytes())
            return self._prompt_bytes[start * 8:end * 8]
        return array("q", self.token_slice(start, end)).tobytes()

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
