"""/v1/completions and /v1/chat/completions: request → engine jobs → JSON or SSE in OpenAI's
shapes. Tokenization happens here (the HTTP thread; the engine only gets token ids), so prompt
lengths are known for the context check and the usage counts before anything is queued."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfit.engine.request_check import check_request
from kvfit.server.engine_loop import Delta, EngineLoop
from kvfit.server.errors import APIError, sse_error
from kvfit.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                   ChatLogprobs, ChatMessageOut, ChatTokenLogprob, ChatTopLogprob,
                                   CompletionChoice, CompletionLogprobs, CompletionRequest,
                                   CompletionResponse, PromptTokensDetails, UsageInfo,
                                   random_id)
from kvfit.server.serving import Submission, ensure_serving, gather
from kvfit.server.sse_chunks import ChunkFormatter
from kvfit.server.structured_request import structured_outputs_of

logger = logging.getLogger("kvfit.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TokenStrings:
    """token id -> its text (cached), for logprob entries."""

    def __init__(self, tokenizer):
        self.tok, self.cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if self.tok is not None else str(tid)
            self.cache[tid] = s
        return s


class _SubmissionStream(StreamingResponse):
    """A StreamingResponse that aborts its submission's unfinished requests however it ends
    (the generator's own ``finally`` never runs if the client left before the first chunk)."""

    def __init__(self, content, sub: Submission):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._sub = sub

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._sub.close(disconnected=True)  # no-op when every choice finished


async def _guarded(events, sub, rid: str):
    """Wrap a response's SSE events: an error after the headers went out becomes an error event,
    the stream always ends with ``data: [DONE]``, and the submission is closed (aborting what is
    still running when the client went away mid-stream)."""
    clean = False
    try:
        async for event in events:
            yield event
        clean = True
    except APIError as e:
        clean = True
        yield sse_error(e)
    except Exception as e:  # noqa: BLE001 - headers are sent: end the stream politely
        clean = True
        logger.exception("error while streaming %s", rid)
        yield sse_error(APIError(500, f"internal server error ({type(e).__name__})"))
    finally:
        sub.close(disconnected=not clean)
    yield "data: [DONE]\n\n"


def _sse(model) -> str:
    return f"data: {model.model_dump_json(exclude_unset=False)}\n\n"


def _check_context(loop: EngineLoop, ids: list[int], max_tokens: Optional[int], chat: bool) -> int:
    """The max_tokens to use (remaining context when None); ``RequestRejected`` (a 400 with its
    ``param`` and ``code``) when the request can never be served: the engine's own check."""
    return check_request(ids, max_tokens, loop.max_model_len, loop.vocab_size,
                         "messages" if chat else "prompt")


def _expand(req, ids: list[int], max_tokens: int, logprobs, prompt_logprobs=None) -> list:
    """n jobs for one prompt; a seeded request gets seeds seed, seed+1, ... (n distinct samples,
    wrapped around within int64)."""
    jobs = []
    for i in range(req.n):
        sp = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
        if req.seed is not None:
            sp.seed = (req.seed + i + 2**63) % 2**64 - 2**63
        jobs.append((ids, sp))
    return jobs


async def _start(sub: Submission, req) -> None:
    """Submit; an engine rejection of the grammar names the field the client used."""
    try:
        await sub.start()
    except APIError as e:
        if e.param == "structured_outputs":
            used = structured_outputs_of(req)[0] or "structured_outputs"
            e.param, e.message = used, e.message.replace("structured_outputs", used)
        raise


def _text_delta(prev: str, text: str) -> tuple[str, str]:
    """(new text, text sent so far)."""
    # NOTE: the engine never shortens a request's text (it holds back partial UTF-8 and
    # possible stop-string prefixes), so the new text is always an extension.
    return (text[len(prev):], text) if text.startswith(prev) else ("", prev)


# ---- /v1/completions -----------------------------------------------------------------------


def _completion_prompts(prompt, tok) -> list[tuple[Optional[str], list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, int):  # a single token-id prompt
            return [(None, [int(t) for t in prompt])]
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            out.append((p, tok(p)["input_ids"]))
        else:
            out.append((None, [int(t) for t in p]))
    return out


def _completion_logprobs(ids: list[int], lps: list[Optional[dict]], tokstr: TokenStrings,
                         into: CompletionLogprobs, offset: int) -> int:
    """Append entries for ``ids`` (``lps[i]`` None = no logprob, e.g. the first prompt token)."""
    for tid, d in zip(ids, lps):
        s = tokstr(tid)
        into.tokens.append(s)
        into.text_offset.append(offset)
        offset += len(s)
        if d is None:
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            into.token_logprobs.append(d.get(tid))
            into.top_logprobs.append({tokstr(t): lp for t, lp in d.items()})
    return offset


async def create_completion(req: CompletionRequest, raw: Request, loop: EngineLoop,
                            model_name: str):
    ensure_serving(loop)
    req.check_unsupported("/v1/completions")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (leave it unset or equal to n)",
                       param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    tok = loop.tokenizer
    prompts = _completion_prompts(req.prompt, tok)
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    jobs: list = []
    for _, ids in prompts:
        max_tokens = _check_context(loop, ids, req.max_tokens, chat=False)
        jobs += _expand(req, ids, max_tokens, req.logprobs, prompt_lp)
    echo_text = [(t if t is not None else (tok.decode(ids) if tok is not None else ""))
                 if req.echo else "" for t, ids in prompts for _ in range(req.n)]
    n_prompt = sum(len(ids) for _, ids in prompts)
    sub = Submission(loop, jobs, raw)
    await _start(sub, req)
    rid, created, tokstr = random_id("cmpl"), int(time.time()), TokenStrings(tok)
    want_lp = req.logprobs is not None

    def logprobs_of(index: int, d: Delta, first: bool, offset: int):
        if not want_lp:
            return None, offset
        lp = CompletionLogprobs()
        if first and req.echo:
            ids = jobs[index][0]
            plp = d.prompt_logprobs or [None] * len(ids)
            offset = _completion_logprobs(ids, plp, tokstr, lp, offset)
        offset = _completion_logprobs(d.new_token_ids, d.new_logprobs or [None] * len(
            d.new_token_ids), tokstr, lp, offset)
        return lp, offset

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        plain = ChunkFormatter(CompletionResponse(id=rid, created=created, model=model_name,
                                                  choices=[]))

        async def stream():
            prev, offsets, ntok = [""] * len(jobs), [0] * len(jobs), [0] * len(jobs)
            first, cached = [True] * len(jobs), [0] * len(jobs)
            async for index, d in sub.events(poll_client=False):
                text, prev[index] = _text_delta(prev[index], d.text)
                lp, offsets[index] = logprobs_of(index, d, first[index], offsets[index])
                if first[index]:
                    text, first[index] = echo_text[index] + text, False
                ntok[index], cached[index] = d.num_tokens, d.num_cached_tokens
                if lp is None:  # the per-token hot path: no models built
                    yield plain.completion(index, text, d.finish_reason)
                    continue
                yield _sse(CompletionResponse(id=rid, created=created, model=model_name,
                                              choices=[CompletionChoice(
                                                  index=index, text=text, logprobs=lp,
                                                  finish_reason=d.finish_reason)]))
            if include_usage:
                yield _sse(CompletionResponse(id=rid, created=created, model=model_name,
                                              choices=[], usage=_usage(
                                                  n_prompt, sum(ntok), cached[::req.n])))

        return _SubmissionStream(_guarded(stream(), sub, rid), sub)

    per_choice = await gather(sub)
    choices, n_out = [], 0
    cached = [deltas[-1].num_cached_tokens for deltas in per_choice][::req.n]
    for index, deltas in enumerate(per_choice):
        last = deltas[-1]
        n_out += last.num_tokens
        lp, offset = None, 0
        if want_lp:
            lp = CompletionLogprobs()
            for k, d in enumerate(deltas):
                part, offset = logprobs_of(index, d, k == 0, offset)
                for f in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
                    getattr(lp, f).extend(getattr(part, f))
        choices.append(CompletionChoice(index=index, text=echo_text[index] + last.text,
                                        logprobs=lp, finish_reason=last.finish_reason))
    return JSONResponse(CompletionResponse(id=rid, created=created, model=model_name,
                                           choices=choices,
                                           usage=_usage(n_prompt, n_out, cached)).model_dump())


def _usage(n_prompt: int, n_out: int, cached: list[int]) -> UsageInfo:
    """``cached``: prompt tokens served from the prefix cache, one entry per distinct prompt
    (its first choice; the n - 1 others share that prompt and its count)."""
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out,
                     total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)))


# ---- /v1/chat/completions ------------------------------------------------------------------


def chat_prompt_ids(req: ChatCompletionRequest, tok) -> list[int]:
    """The chat template applied to the messages (generation prompt added), as token ids."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    msgs: list[dict[str, Any]] = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tok.apply_chat_template(msgs, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # jinja raises for roles/orders a template does not allow
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages")
    return tok(text, add_special_tokens=False)["input_ids"]


def _chat_logprobs(d: Delta, tokstr: TokenStrings, n_top: int) -> Optional[ChatLogprobs]:
    """OpenAI chat logprobs: each token with its logprob and the ``n_top`` most likely tokens."""
    if d.new_logprobs is None:
        return None
    content = []
    for tid, lps in zip(d.new_token_ids, d.new_logprobs):
        s = tokstr(tid)
        best = sorted(lps.items(), key=lambda kv: -kv[1])[:n_top]
        top = [ChatTopLogprob(token=tokstr(t), logprob=lp, bytes=list(tokstr(t).encode()))
               for t, lp in best]
        content.append(ChatTokenLogprob(token=s, logprob=lps.get(tid, float("-inf")),
                                        bytes=list(s.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, loop: EngineLoop,
                                 model_name: str):
    ensure_serving(loop)
    req.check_unsupported("/v1/chat/completions")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}",
                       param="top_logprobs")
    tok = loop.tokenizer
    ids = chat_prompt_ids(req, tok)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _check_context(loop, ids, asked, chat=True)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    jobs = _expand(req, ids, max_tokens, logprobs)
    sub = Submission(loop, jobs, raw)
    await _start(sub, req)
    rid, created, tokstr = random_id("chatcmpl"), int(time.time()), TokenStrings(tok)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None):
            return _sse(ChatCompletionChunk(id=rid, created=created, model=model_name,
                                            choices=choices, usage=usage))

        plain = ChunkFormatter(ChatCompletionChunk(id=rid, created=created, model=model_name,
                                                   choices=[]))

        async def stream():
            prev, ntok, cached = [""] * len(jobs), [0] * len(jobs), [0]
            for i in range(len(jobs)):
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                      content=""))])
            async for index, d in sub.events(poll_client=False):
                text, prev[index] = _text_delta(prev[index], d.text)
                ntok[index] = d.num_tokens
                if index == 0:
                    cached[0] = d.num_cached_tokens
                content = text if text or d.finish_reason is None else None
                lp = _chat_logprobs(d, tokstr, logprobs or 0)
                if lp is None:  # the per-token hot path: no models built
                    yield plain.chat(index, content, d.finish_reason)
                    continue
                delta = ChatDelta() if content is None else ChatDelta(content=content)
                yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=lp,
                                             finish_reason=d.finish_reason)])
            if include_usage:
                yield chunk([], _usage(len(ids), sum(ntok), cached))

        return _SubmissionStream(_guarded(stream(), sub, rid), sub)

    per_choice = await gather(sub)
    choices, n_out = [], 0
    for index, deltas in enumerate(per_choice):
        last = deltas[-1]
        n_out += last.num_tokens
        lp = None
        if logprobs is not None:
            lp = ChatLogprobs(content=[c for d in deltas
                                       for c in _chat_logprobs(d, tokstr, logprobs).content])
        choices.append(ChatChoice(index=index, message=ChatMessageOut(content=last.text),
                                  logprobs=lp, finish_reason=last.finish_reason))
    return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=model_name,
                                               choices=choices,
                                               usage=_usage(len(ids), n_out, [
                                                   per_choice[0][-1].num_cached_tokens])
                                               ).model_dump())
