"""OpenAI request and response bodies (pydantic), and their translation into SamplingParams.

Owns only data shapes: nothing here touches the engine. Known fields are type-checked by
pydantic and range-checked here or by ``SamplingParams.validate`` (a ``RequestRejected`` naming
the field); fields the models do not declare are judged by ``params_policy`` (refused when they
would change the output, else ignored with a warning).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvfit.errors import RequestRejected
from kvfit.sampling_params import SamplingParams
from kvfit.server.params_policy import check_extra_fields
from kvfit.server.structured_request import (ResponseFormat, StructuredOutputsRequest,
                                             structured_outputs_of)

_INT64 = (-(2**63), 2**63 - 1)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _documented(default, **bounds):
    """A field whose allowed range is stated in the OpenAPI schema (clients and the fuzzer see
    it) but checked by ``SamplingParams``/the handlers, whose 400s name the field and range."""
    return Field(default, json_schema_extra=bounds)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = _documented(None, minimum=1)
    temperature: float = _documented(1.0, minimum=0, maximum=100)
    top_p: float = _documented(1.0, exclusiveMinimum=0, maximum=1)
    top_k: int = _documented(-1, minimum=-1)
    min_p: float = _documented(0.0, minimum=0, maximum=1)
    n: int = _documented(1, minimum=1, maximum=64)
    seed: Optional[int] = _documented(None, minimum=_INT64[0], maximum=_INT64[1])
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = _documented(None, items={"type": "integer",
                                                                   "minimum": 0})
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    user: Optional[str] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[str, float]] = _documented(
        None, propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100})
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def check_unsupported(self, endpoint: str = "") -> None:
        """Once per HTTP request: the parameter policy (``params_policy``) on undeclared fields,
        n, seed and stream_options; penalties are not implemented: refuse a non-neutral value,
        never ignore it."""
        check_extra_fields(self.model_extra or {}, endpoint)
        if self.stream_options is not None and not self.stream:
            raise RequestRejected("stream_options is only allowed when stream is true",
                                  param="stream_options")
        if self.seed is not None and not _INT64[0] <= self.seed <= _INT64[1]:
            raise RequestRejected(f"seed must be a 64-bit integer (in [{_INT64[0]}, "
                                  f"{_INT64[1]}]), got {self.seed}", param="seed")
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
        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=logit_bias_ids(
                self.logit_bias), structured_outputs=structured_outputs_of(self)[1])


def logit_bias_ids(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (token-id strings -> bias) as {int id: bias}, with OpenAI's
    errors (the vocabulary bound is checked by the engine)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        k = key.strip()
        if not (k.isascii() and k.isdigit()):
            raise RequestRejected(f"Invalid key in 'logit_bias': {key!r}. You should only be "
                                  "submitting non-negative integers.", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestRejected(f"Invalid value in 'logit_bias' for token {k}: {value}. "
                                  "Expected a value between -100 and 100.", param="logit_bias")
        out[int(k)] = float(value)
    return out


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt`` is a string, a list of strings, a list of token ids or a
    list of token-id lists (lm-eval's ``local-completions`` sends token ids)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = _documented(16, minimum=1)
    logprobs: Optional[int] = _documented(None, minimum=0, maximum=20)
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
    max_completion_tokens: Optional[int] = _documented(None, minimum=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = _documented(None, minimum=0, maximum=20)
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
