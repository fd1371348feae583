"""LLMEngine: requests in, outputs out, one ``step()`` at a time. Not thread-safe: one thread
(the offline loop or the server's engine thread) drives it."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional, Union

import torch

from kvfit.config import EngineConfig
from kvfit.engine.detokenizer import IncrementalDetokenizer
from kvfit.engine.request_check import check_request
from kvfit.engine.runner import ModelRunner
from kvfit.engine.sampling import SamplingBatch, sample, top_logprobs
from kvfit.engine.settings import resolve_settings
from kvfit.errors import RequestRejected
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.prefix_cache import PrefixCachingAllocator, kv_identity
from kvfit.models.registry import load_tokenizer
from kvfit.outputs import CompletionOutput, RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import Request, Status
from kvfit.scheduler.scheduler import Scheduler

log = logging.getLogger("kvfit")


class LLMEngine:
    """Owns the runner, the scheduler and every live request (mutated by ``step``/``abort``)."""

    def __init__(self, config: EngineConfig):
        self.settings = resolve_settings(config)  # checked before anything is loaded
        src = self.settings.source
        try:
            self.tokenizer = load_tokenizer(src, config.tokenizer)
        except Exception as e:  # a bare config.json (dummy weights) may come without one
            if src.kind != "config":
                raise
            log.info("no tokenizer for %s (%s): token-id prompts only", config.model, e)
            self.tokenizer = None
        self.runner = ModelRunner(self.settings, self.tokenizer)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self.config = config = self.settings.config  # page_size resolved
        self.allocator = self._make_allocator()
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.runner.pool.sliding_pages)
        self.requests: dict[str, Request] = {}
        self.eos_ids = self._eos_ids()
        self._arrival = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _make_allocator(self) -> PageAllocator:
        """A PrefixCachingAllocator when prefix caching is asked for and the pool can share full
        pages (vLLM's behaviour: an unsupported model runs with it off and says why), else a
        plain PageAllocator. Logs whether it is on."""
        pool, c = self.runner.pool, self.config
        refusal = pool.prefix_caching_refusal
        if not c.enable_prefix_caching:
            log.info("prefix caching: off (--no-enable-prefix-caching)")
            return PageAllocator(pool.num_pages)
        if refusal is not None:
            log.info("prefix caching: off, the %s pool cannot share pages: %s", pool.name, refusal)
            return PageAllocator(pool.num_pages)
        model_id = (c.model, c.load_format, c.seed if c.load_format == "dummy" else None,
                    str(self.runner.dtype))
        log.info("prefix caching: on (full pages of %d tokens of %s are shared; "
                 "--no-enable-prefix-caching turns it off)", c.page_size, pool.fmt.name)
        return PrefixCachingAllocator(pool.num_pages, lambda: kv_identity(model_id, pool))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.runner.hf_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int]],
                    params: SamplingParams) -> None:
        """Queue a request, or raise RequestRejected if it could never be served."""
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: send token ids", "prompt")
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        else:
            text, ids = None, [int(t) for t in prompt]
        params.max_tokens = check_request(ids, params.max_tokens, self.max_model_len,
                                          self.vocab_size)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size}), got "
                                  f"{max(params.logit_bias)}", "logit_bias")
        seed = params.seed
        if seed is None:  # drawn from the engine's RNG (EngineConfig.seed): runs repeat
            seed = 0 if params.greedy else int(
                torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, text, ids, params, seed, next(self._arrival))
        req.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request as 'abort' and free its pages now. False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def prefix_caching(self) -> bool:
        return isinstance(self.allocator, PrefixCachingAllocator)

    def stats(self) -> dict:
        cache = self.allocator if self.prefix_caching else None
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "pages_used": self.allocator.num_used, "pages_free": self.allocator.num_free,
                "pages_total": self.allocator.num_pages, "page_size": self.config.page_size,
                "kv_dtype": self.runner.kv_format.name,
                "num_preemptions": self.scheduler.num_preemptions,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "prefix_caching": cache is not None,
                "prefix_cache_queries": cache.num_queries if cache else 0,
                "prefix_cache_hits": cache.num_hits if cache else 0,
                "pages_cached": cache.num_cached if cache else 0}

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        items = batch.items
        sample_mask = [r.num_computed_tokens + n == r.num_tokens for r, n in items]
        prompt_lp = [r.wants_prompt_logprobs() and r.num_computed_tokens < r.num_prompt_tokens
                     for r, n in items]
        result = self.runner.execute(items, sample_mask, prompt_lp)
        for i, (req, n) in enumerate(items):
            if i in result.prompt_rows:
                start, lp = result.prompt_rows[i]
                for j in range(n):  # row j predicts the token at position start + j + 1
                    pos = start + j + 1
                    if len(req.prompt_logprobs) == pos and pos < req.num_prompt_tokens:
                        tok = req.prompt_token_ids[pos]
                        req.prompt_logprobs.append(top_logprobs(lp[j], tok,
                                                                req.params.prompt_logprobs))
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.prompt_tokens_total += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
        self.scheduler.cache_full_pages(items)
        samplers = [req for (req, _), s in zip(items, sample_mask) if s]
        outputs = []
        if samplers:
            batch = SamplingBatch.build([r.params for r in samplers],
                                        [r.sampling_seed for r in samplers],
                                        [r.num_tokens for r in samplers],
                                        result.sample_logits.shape[-1], result.sample_logits.device)
            sampled = sample(result.sample_logits, batch)
            tokens = sampled.token_ids.tolist()  # the step's one device-to-host copy of ids
            logprobs = sampled.logprob_dicts(tokens)
            now = time.monotonic()
            for row, (req, tok) in enumerate(zip(samplers, tokens)):
                self._append(req, tok, logprobs.get(row), now)
                outputs.append(self._output(req))
        return outputs

    def _append(self, req: Request, tok: int, lp: Optional[dict[int, float]], now: float) -> None:
        """Append a sampled token (``lp``: its logprob dict when the request asked for logprobs),
        then decide whether the request finishes."""
        p = req.params
        req.output_token_ids.append(tok)
        self.generation_tokens_total += 1
        if req.t_first_token is None:
            req.t_first_token = now
        if req.logprobs is not None:
            req.cumulative_logprob += lp[tok]
            req.logprobs.append(lp)
        reason, stop_reason = None, None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        full = req.detok.update(req.output_token_ids, final=reason is not None)
        if reason is None and p.stop:
            tail = max(0, len(req.text) - max(len(x) for x in p.stop))
            for stop in p.stop:
                at = full.find(stop, tail)
                if at >= 0:
                    full = full[:at]
                    reason, stop_reason = "stop", stop
                    break
        if reason is None and (len(req.output_token_ids) >= p.max_tokens
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason == "length":
            full = req.detok.update(req.output_token_ids, final=True)
        if reason is None:
            # while running, hold back what could be the start of a stop string
            hold = max((len(x) for x in p.stop), default=1) - 1
            full = full[: len(full) - hold] if hold else full
        req.text = full if len(full) >= len(req.text) or reason is not None else req.text
        if reason is not None:
            self.scheduler.finish(req, reason, stop_reason)
            self.requests.pop(req.request_id, None)

    @staticmethod
    def _output(req: Request) -> RequestOutput:
        comp = CompletionOutput(0, req.text, list(req.output_token_ids),
                                req.cumulative_logprob if req.logprobs is not None else None,
                                list(req.logprobs) if req.logprobs is not None else None,
                                req.finish_reason, req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp],
                             req.finished, req.prompt_logprobs,
                             {"arrival": req.t_arrival, "first_token": req.t_first_token,
                              "num_preemptions": req.num_preemptions},
                             req.num_cached_tokens or 0)
