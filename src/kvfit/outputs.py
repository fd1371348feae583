"""What generation returns (vLLM's shape): RequestOutput with CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
