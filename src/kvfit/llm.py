"""The offline API: ``LLM(model, **engine_config).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence, Union

from kvfit.config import make_config
from kvfit.engine.llm_engine import LLMEngine
from kvfit.outputs import RequestOutput
from kvfit.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]


class LLM:
    """Owns one LLMEngine. Keyword arguments are EngineConfig fields (a typo is a TypeError)."""

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs):
        self.config = make_config(model=model, **engine_kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also done at exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's ``LLM.reset_prefix_cache``); False when
        prefix caching is off."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (str, token-id list, or {"prompt_token_ids": [...]});
        returns the finished outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, sampling_params):
                rid = f"offline-{next(self._ids)}"
                if isinstance(p, dict):
                    p = p.get("prompt_token_ids", p.get("prompt"))
                self.engine.add_request(rid, p, _copy(sp))
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:  # leave the engine clean if interrupted
                self.engine.abort_request(rid)
            raise

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """``messages``: one conversation (list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        prompts = [tok.apply_chat_template(c, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
                   for c in convs]
        token_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate([{"prompt_token_ids": t} for t in token_ids], sampling_params,
                             use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        t0 = time.monotonic()
        in0 = self.engine.prompt_tokens_total
        out0 = self.engine.generation_tokens_total
        wanted = set(ids)
        while wanted - done.keys():
            for out in self.engine.step(final_only=True):
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        dt = max(time.monotonic() - t0, 1e-9)
                        bar.set_postfix_str(
                            f"input: {(self.engine.prompt_tokens_total - in0) / dt:.1f} toks/s, "
                            f"output: {(self.engine.generation_tokens_total - out0) / dt:.1f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _copy(sp: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(sp)
