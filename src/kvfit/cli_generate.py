"""``kvfit generate`` after its arguments are parsed: build the engine, cap the default
``--max-tokens`` to what ``--max-model-len`` leaves after the prompt (and say so), generate, print
the texts on stdout and, on stderr, why each generation stopped and how fast it ran."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from kvfit.config import EngineConfig
from kvfit.errors import RequestRejected
from kvfit.outputs import RequestOutput
from kvfit.sampling_params import SamplingParams

log = logging.getLogger("kvfit")


def prompt_token_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """The token ids the engine will see for ``text`` (through the chat template if ``chat``)."""
    if tokenizer is None:
        raise RequestRejected("this model has no tokenizer (a bare config.json): pass --tokenizer "
                              "DIR", "prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestRejected("this model's tokenizer has no chat template; drop --chat",
                                  "chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def cap_max_tokens(params: SamplingParams, n_prompt: int, max_model_len: int,
                   given: bool) -> tuple[SamplingParams, bool]:
    """``params`` with max_tokens lowered to the room left after the prompt when the user did
    not set it (an explicit value is kept: the engine then refuses it with both numbers).
    Returns (params, whether it was capped)."""
    room = max_model_len - n_prompt
    if given or params.max_tokens <= room:
        return params, False
    if room < 1:  # the prompt alone is too long: the engine's refusal then names 1, not 128
        return dataclasses.replace(params, max_tokens=1), False
    return dataclasses.replace(params, max_tokens=room), True


def stop_description(out: RequestOutput, max_tokens: int, max_model_len: int,
                     capped: bool = False) -> str:
    """Why a generation stopped, in the user's terms (``capped``: max_tokens is the room the
    context left, not the user's limit)."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        if len(c.token_ids) >= max_tokens and not capped:
            return f"length (the --max-tokens limit of {max_tokens} tokens)"
        return f"length (the --max-model-len of {max_model_len} tokens)"
    if c.finish_reason == "stop":
        if c.stop_reason is None:
            return "EOS (the model ended its answer)"
        return f"stop ({c.stop_reason!r})"
    return str(c.finish_reason)


def run_generate(cfg: EngineConfig, prompts: list[str], params: SamplingParams, chat: bool,
                 max_tokens_given: bool) -> int:
    from kvfit.llm import LLM

    llm = LLM(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    max_len = llm.engine.max_model_len
    ids = [prompt_token_ids(llm.get_tokenizer(), p, chat) for p in prompts]
    per_prompt, capped_flags = [], []
    for n in map(len, ids):
        sp, capped = cap_max_tokens(params, n, max_len, max_tokens_given)
        capped_flags.append(capped)
        if capped:
            log.warning("--max-tokens not given: generating at most %d tokens instead of the "
                        "default %d, what --max-model-len %d leaves after the %d-token prompt",
                        sp.max_tokens, params.max_tokens, max_len, n)
        per_prompt.append(sp)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": t} for t in ids], per_prompt,
                        use_tqdm=len(prompts) > 1)
    seconds = max(time.monotonic() - t0, 1e-9)
    for i, (out, sp, capped) in enumerate(zip(outs, per_prompt, capped_flags)):
        if len(outs) > 1:
            print(f"--- prompt {i + 1} ---")
        print(out.outputs[0].text, flush=True)
        print(f"kvfit: stopped on {stop_description(out, sp.max_tokens, max_len, capped)}",
              file=sys.stderr)
    n_in = sum(map(len, ids))
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"kvfit: {_count(len(outs), 'prompt')} ({_count(n_in, 'token')}), "
          f"{_count(n_out, 'token')} generated in {seconds:.2f} s: {n_out / seconds:.1f} tok/s",
          file=sys.stderr)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
