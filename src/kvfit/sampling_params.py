"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from kvfit.errors import RequestRejected


@dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k -1/0 = off, top_p 1 = off, min_p 0 = off.

    logprobs: None, or N >= 0: return the chosen token's logprob plus the top-N per step.
    prompt_logprobs: None, or N >= 0: logprobs of every prompt token (for echo/lm-eval).
    logit_bias: None, or {token id: bias in [-100, 100]} added to the logits before sampling and
    before the greedy argmax (OpenAI's meaning: +100 forces a token, -100 bans it). The engine
    checks the ids against the vocabulary at ``add_request``.
    """

    n: int = 1
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(param, msg):
            raise RequestRejected(f"{param} {msg}", param=param)

        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= 20):
                bad(name, f"must be in [0, 20], got {v}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _checked_logit_bias(bias) -> dict[int, float]:
    """{token id: bias} with int ids >= 0 and finite biases in [-100, 100], else RequestRejected."""
    if not isinstance(bias, dict):
        raise RequestRejected(f"logit_bias must be a map from token id to bias, got "
                              f"{type(bias).__name__}", param="logit_bias")
    out = {}
    for tok, val in bias.items():
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise RequestRejected(f"logit_bias keys must be non-negative integer token ids, got "
                                  f"{tok!r}", param="logit_bias")
        if (isinstance(val, bool) or not isinstance(val, (int, float))
                or not math.isfinite(val) or not -100.0 <= val <= 100.0):
            raise RequestRejected(f"logit_bias values must be numbers in [-100, 100], got {val!r} "
                                  f"for token {tok}", param="logit_bias")
        out[tok] = float(val)
    return out
