"""What generation returns (vLLM's shape): RequestOutput with CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CompletionOutput:
    """One generated sequence so far. ``logprobs[i]`` maps token id -> logprob at step i (the
    chosen token first, then the top-N); ``finish_reason`` is None while running, else
    'stop' (EOS, stop token or stop string), 'length' (max_tokens or context) or 'abort'."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, float]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """When a request went through the engine (vLLM's ``RequestMetrics`` names). Times are
    seconds on ``time.monotonic()``'s clock (differences are what mean something: TTFT =
    ``first_token_time - arrival_time``); None until it happened."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None  # first admitted into a step
    first_token_time: Optional[float] = None  # first output token read back
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> Optional[float]:
        """Seconds from arrival to the first step that ran it."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
