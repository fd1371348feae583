"""The one check of a request's length and token ids against the engine's limits.

Both ``LLMEngine.add_request`` and the HTTP handlers (server/handlers.py, before a request is
queued, so that the client gets its 400 at once) call ``check_request``; the wording is OpenAI's.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

from kvfit.errors import RequestRejected


def token_id_list(prompt: Sequence) -> list[int]:
    """A prompt's token ids as a list of Python ints. Integers (Python, numpy, bool) go through
    one C-level ``array`` conversion (a 4k-token prompt: ~4x faster than ``int()`` per id);
    anything else falls back to ``int()`` per element, whose error names the bad value."""
    try:
        return array("q", prompt).tolist()
    except (TypeError, OverflowError):
        return [int(t) for t in prompt]


def context_too_long(max_model_len: int, n_prompt: int, n_out: int,
                     prompt_param: str = "prompt") -> RequestRejected:
    """OpenAI's error for prompt + completion over the context; ``param`` is the prompt's field
    when the prompt alone fills the context, else ``max_tokens``."""
    what = prompt_param
    return RequestRejected(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{n_prompt + n_out} tokens ({n_prompt} in the {what}, {n_out} in the completion). "
        f"Please reduce the length of the {what} or completion.",
        "max_tokens" if n_prompt < max_model_len else what, code="context_length_exceeded")


def check_request(prompt_ids: Sequence[int], max_tokens: Optional[int], max_model_len: int,
                  vocab_size: Optional[int] = None, prompt_param: str = "prompt") -> int:
    """The number of tokens to generate for a prompt, or ``RequestRejected`` when it can never be
    served: an empty prompt, a token id outside ``[0, vocab_size)``, ``max_tokens < 1``, or
    prompt + ``max_tokens`` over ``max_model_len``. ``max_tokens=None`` means the rest of the
    context. ``prompt_param`` names the prompt's field in errors ("prompt" or "messages")."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestRejected(f"the {prompt_param} is empty", prompt_param)
    if vocab_size is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size):
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}",
                                  prompt_param)
    if max_tokens is None:
        if n >= max_model_len:
            raise context_too_long(max_model_len, n, 1, prompt_param)
        return max_model_len - n
    if max_tokens < 1:
        raise RequestRejected(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if n + max_tokens > max_model_len:
        raise context_too_long(max_model_len, n, max_tokens, prompt_param)
    return max_tokens
