"""One policy for request parameters: every OpenAI (and vLLM-extra) parameter is implemented, has
no effect on the output, or is refused with a 400 naming it when set to anything but its neutral
value. Fields nobody knows are ignored with one warning line in the log (vLLM's behaviour), so
newer clients keep working but nothing that would change the output is silently dropped.

``check_extra_fields`` is called once per HTTP request on the pydantic model's ``model_extra``
(the fields the protocol models do not declare).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvfit.server.errors import APIError

logger = logging.getLogger("kvfit.server")


def _unset(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _text_only(v: Any) -> bool:
    return v is None or v == ["text"]


def _no_tool_call(v: Any) -> bool:
    return v in (None, "none", "auto")


def _equals(neutral) -> Callable[[Any], bool]:
    return lambda v: v is None or v == neutral


# Known parameters kvfit does not implement: {name: is the value neutral?}. A neutral value is
# accepted (it asks for nothing), anything else is a 400 naming the parameter.
REFUSED: dict[str, Callable[[Any], bool]] = {
    # OpenAI
    "tools": _falsy, "tool_choice": _no_tool_call, "functions": _falsy,
    "function_call": _no_tool_call, "audio": _unset, "modalities": _text_only,
    "prediction": _unset, "web_search_options": _unset, "reasoning_effort": _unset,
    "verbosity": _unset,
    # vLLM extras that change the output
    "min_tokens": _equals(0), "use_beam_search": _falsy, "length_penalty": _equals(1.0),
    "include_stop_str_in_output": _falsy, "bad_words": _falsy, "allowed_token_ids": _falsy,
    "truncate_prompt_tokens": _unset, "prompt_logprobs": _unset,
    "spaces_between_special_tokens": _equals(True), "chat_template": _unset,
    "chat_template_kwargs": _falsy, "continue_final_message": _falsy, "documents": _falsy,
    "guided_whitespace_pattern": _unset, "structural_tag": _unset, "priority": _equals(0),
    "mm_processor_kwargs": _falsy, "logits_processors": _falsy, "vllm_xargs": _falsy,
    "echo": _falsy,  # chat only (completions implements it): echo the last message
    "add_special_tokens": _unset,
}

# Known parameters that do not change what is generated (bookkeeping on OpenAI's side, or
# choices kvfit makes anyway): accepted without a warning.
NO_EFFECT = frozenset({
    "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "safety_identifier", "request_id", "guided_decoding_backend", "return_tokens_as_token_ids",
    "cache_salt", "kv_transfer_params",
})


def check_extra_fields(extra: dict[str, Any], endpoint: str) -> None:
    """Refuse a known-but-unimplemented parameter set to a non-neutral value (APIError 400
    naming it); log one warning line listing the unknown ones."""
    unknown = []
    for name, value in extra.items():
        neutral = REFUSED.get(name)
        if neutral is not None:
            if not neutral(value):
                raise APIError(400, f"{name} is not supported by kvfit; leave it unset",
                               param=name)
        elif name not in NO_EFFECT:
            unknown.append(name)
    if unknown:
        logger.warning("%s: ignoring unknown fields %s", endpoint, ", ".join(sorted(unknown)))
