"""OpenAI request and response bodies (pydantic), and their translation into SamplingParams.

Owns only data shapes: nothing here touches the engine. Unknown request fields are ignored (as
OpenAI-compatible servers do, so newer clients keep working); known fields are type-checked by
pydantic and range-checked by ``SamplingParams.validate`` (a ``RequestRejected`` naming the field).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvfit.errors import RequestRejected
from kvfit.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    user: Optional[str] = None

    def check_unsupported(self) -> None:
        """Check n; penalties are not implemented: refuse a non-neutral value, never ignore it."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise RequestRejected(f"{name} is not supported by kvfit; leave it at {neutral}",
                                      param=name)
        if self.n < 1:
            raise RequestRejected(f"n must be >= 1, got {self.n}", param="n")
        if self.n > 64:
            raise RequestRejected(f"n must be in [1, 64], got {self.n}", param="n")

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """One engine request's parameters (n is expanded by the caller into n requests)."""
        self.check_unsupported()
        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt`` is a string, a list of strings, a list of token ids or a
    list of token-id lists (lm-eval's ``local-completions`` sends token ids)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """The message text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestRejected("only text content parts are supported", param="messages")
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. ``logprobs`` is a bool here and ``top_logprobs`` the count."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """A streamed message delta: unset fields are left out (``{}`` on the final chunk), as
    OpenAI sends them."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvfit"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
