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
from kvfit.engine.preflight import check_memory, check_runs_here
from kvfit.engine.request_check import check_request, prompt_ids
from kvfit.engine.runner import ModelRunner
from kvfit.engine.inflight import InFlightStep, launch_sampling
from kvfit.engine.sampling import top_logprobs
from kvfit.engine.settings import resolve_settings
from kvfit.errors import RequestRejected
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.prefix_cache import PrefixCachingAllocator, kv_identity
from kvfit.models.gguf_readers import shared_gguf_readers
from kvfit.models.registry import load_tokenizer
from kvfit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.scheduler.request import PLACEHOLDER, Request
from kvfit.scheduler.scheduler import Scheduler

log = logging.getLogger("kvfit")


class LLMEngine:
    """Owns the runner, the scheduler and every live request (mutated by ``step``/``abort``)."""

    def __init__(self, config: EngineConfig):
        check_runs_here(config)  # device and named backend: no model read yet
        with shared_gguf_readers():  # a GGUF's metadata parsed once for config, tokenizer, weights
            self._load(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self.config = config = self.settings.config  # page_size resolved
        self.allocator = self._make_allocator()
        pool = self.runner.pool
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, pool.sliding_pages,
                                   pool.residual_slots)
        self.requests: dict[str, Request] = {}
        self.eos_ids = self._eos_ids()
        self._arrival = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.overlap = config.resolved_async_scheduling
        self._inflight: Optional[InFlightStep] = None  # launched, ids not yet read (overlap)
        self._structured = None  # StructuredOutputs, built on the first structured request

    def _load(self, config: EngineConfig) -> None:
        """Settings, tokenizer and runner (the model's weights), in that order."""
        self.settings = resolve_settings(config)  # checked before anything is loaded
        check_memory(self.settings)  # weights vs memory, before the tokenizer and the weights
        src = self.settings.source
        try:
            self.tokenizer = load_tokenizer(src, config.tokenizer)
        except Exception as e:  # a bare config.json (dummy weights) may come without one
            if src.kind != "config":
                raise
            log.info("no tokenizer for %s (%s): token-id prompts only", config.model, e)
            self.tokenizer = None
        self.runner = ModelRunner(self.settings, self.tokenizer)

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
        int64 = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: send token ids", "prompt")
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        else:
            text, (ids, int64) = None, prompt_ids(prompt)
        params.max_tokens = check_request(ids, params.max_tokens, self.max_model_len,
                                          self.vocab_size, int64=int64)
        self._check_vocab(params)
        seed = params.seed
        if seed is None:  # drawn from the engine's RNG (EngineConfig.seed): runs repeat
            seed = 0 if params.greedy else int(
                torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, text, ids, params, seed, next(self._arrival), int64)
        req.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if params.structured_outputs is not None:
            req.grammar = self._structured_outputs().new_matcher(params.structured_outputs)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _check_vocab(self, params: SamplingParams) -> None:
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise RequestRejected(f"{name}: token id {bad[0]} is out of the vocabulary "
                                      f"(ids are in [0, {self.vocab_size}))", name)

    def _structured_outputs(self):
        if self._structured is None:
            from kvfit.engine.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._structured

    def abort_request(self, request_id: str) -> bool:
        """Finish a request as 'abort' and free its pages now. False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        del req.output_token_ids[req.num_output_confirmed:]  # launched tokens are discarded
        req.num_pending = 0
        self.scheduler.finish(req, "abort")
        return True

    def close(self) -> None:
        """Release what outlives the engine object: under tensor parallelism the worker
        processes and the process group (also done at garbage collection and at exit)."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def prefix_caching(self) -> bool:
        return isinstance(self.allocator, PrefixCachingAllocator)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (running requests keep their pages): later requests
        prefill from scratch, as on a fresh engine (benchmarks that repeat a workload). False when
        prefix caching is off."""
        if not self.prefix_caching:
            return False
        self.allocator.reset()
        return True

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
    def step(self, final_only: bool = False, delta: bool = False) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step whose ids are read.

        Output kinds (vLLM's ``RequestOutputKind``): by default each output holds everything so
        far (a copy of the output ids per running request and step: O(length)); ``final_only``:
        only requests that finished (an offline caller that reads nothing else); ``delta``: the
        token ids and logprobs added since the request's previous output (the text stays
        whole: a string is shared, not copied), for a streaming consumer.

        Synchronous (``async_scheduling`` off): launch step N, wait, process N. Overlapped (on,
        the CUDA default): launch N, then process N-1 while the GPU runs N, so the host's
        scheduling, detokenization and stop checks hide behind the GPU. Decode inputs of N come
        from N-1's device ids. A request that stops at N-1 (EOS / stop string) has had one
        extra token launched in N: it is discarded and the request's pages are freed when N-1
        is processed (stream order keeps N's writes before any later reuse of those pages)."""
        batch = self.scheduler.schedule()
        items = batch.items
        outputs = []
        if self._inflight is not None and any(r.grammar is not None for r, _ in items):
            # structured output: the next mask needs the grammar to have accepted the pending
            # token, so read the in-flight step first (requests it finished drop out)
            outputs = self._process(self._inflight, final_only, delta)
            self._inflight = None
            items = [(r, n) for r, n in items if not r.finished]
        launched = self._launch(items) if items else None
        if self._inflight is not None:
            outputs = self._process(self._inflight, final_only, delta)
        self._inflight = launched
        if not self.overlap and launched is not None:
            outputs += self._process(launched, final_only, delta)
            self._inflight = None
        return outputs

    def _launch(self, items) -> InFlightStep:
        """Run the model over ``items`` and sample on the device; advances each request's
        ``num_computed_tokens`` and appends a placeholder per sampling request."""
        sample_mask = [r.num_computed_tokens + n == r.num_tokens for r, n in items]
        prompt_lp = [r.wants_prompt_logprobs() and r.num_computed_tokens < r.num_prompt_tokens
                     for r, n in items]
        pairs, offset = [], 0
        for req, n in items:
            if req.num_pending:  # its last input token is the previous step's sampled id
                if req.num_computed_tokens + n != req.num_tokens:
                    raise RuntimeError(f"request {req.request_id}: a pending token outside "
                                       f"the step's chunk end (scheduler invariant broken)")
                pairs.append((offset + n - 1, req.pending_row))
            offset += n
        carried = None
        if pairs:
            carried = (self._inflight.sampled.token_ids, pairs)
        result = self.runner.execute(items, sample_mask, prompt_lp, carried)
        samplers = [req for (req, _), s in zip(items, sample_mask) if s]
        bitmask = None  # host work while the forward runs: the structured-output masks
        if samplers and self._structured is not None:
            bitmask = self._structured.fill_bitmask([r.grammar for r in samplers])
        sampled, ids_host, event = launch_sampling(result.sample_logits, samplers, bitmask)
        for req, n in items:
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.prompt_tokens_total += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
        self.scheduler.cache_full_pages(items)  # pages this step fills become shareable
        for row, req in enumerate(samplers):
            req.output_token_ids.append(PLACEHOLDER)
            req.num_pending += 1
            req.pending_row = row
        return InFlightStep(list(items), samplers, sampled, ids_host, event, result.prompt_rows)

    def _process(self, step: InFlightStep, final_only: bool = False,
                 delta: bool = False) -> list[RequestOutput]:
        """Read a launched step's ids (waits for its copy), record prompt logprobs, append the
        tokens, run stop checks, finish and free what stopped; the outputs of live requests."""
        tokens = step.wait_ids()
        for i, (req, n) in enumerate(step.items):
            if i not in step.prompt_rows or req.finished:
                continue
            start, lp = step.prompt_rows[i]
            lp = lp.cpu()
            for j in range(n):  # row j predicts the token at position start + j + 1
                pos = start + j + 1
                if len(req.prompt_logprobs) == pos and pos < req.num_prompt_tokens:
                    tok = req.prompt_token_ids[pos]
                    req.prompt_logprobs.append(top_logprobs(lp[j], tok,
                                                            req.params.prompt_logprobs))
        outputs = []
        now = time.monotonic()
        logprobs = step.sampled.logprob_dicts(tokens) if step.sampled is not None else {}
        for row, (req, tok) in enumerate(zip(step.samplers, tokens)):
            if req.finished:  # stopped at an earlier step or aborted: a discarded extra token
                continue
            done = req.grammar is not None and self._structured.accept(req.grammar, tok)
            self._append(req, tok, logprobs.get(row), now, grammar_done=done)
            if req.finished or not final_only:
                outputs.append(self._output(req, delta))
        return outputs

    def _append(self, req: Request, tok: int, lp: Optional[dict[int, float]], now: float,
                grammar_done: bool = False) -> None:
        """Confirm ``req``'s oldest pending token as ``tok`` (``lp``: its logprob dict when the
        request asked for logprobs), then decide whether the request finishes
        (``grammar_done``: its grammar completed)."""
        p = req.params
        k = req.num_output_confirmed
        out_ids = req.output_token_ids  # confirmed: out_ids[:k + 1] (no per-step copy)
        out_ids[k] = tok
        req.num_pending -= 1
        self.generation_tokens_total += 1
        if req.t_first_token is None:
            req.t_first_token = now
        req.t_last_token = now
        if req.logprobs is not None:
            req.cumulative_logprob += lp[tok]
            req.logprobs.append(lp)
        reason, stop_reason = None, None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.eos_ids or grammar_done:
            reason = "stop"
        full = req.detok.update(out_ids, final=reason is not None, n=k + 1)
        if reason is None and p.stop:
            tail = max(0, len(req.text) - max(len(x) for x in p.stop))
            for stop in p.stop:
                at = full.find(stop, tail)
                if at >= 0:
                    full = full[:at]
                    reason, stop_reason = "stop", stop
                    break
        if reason is None and (k + 1 >= p.max_tokens
                               or req.num_prompt_tokens + k + 1 >= self.max_model_len):
            reason = "length"
        if reason == "length":
            full = req.detok.update(out_ids, final=True, n=k + 1)
        if reason is None:
            # while running, hold back what could be the start of a stop string
            hold = max((len(x) for x in p.stop), default=1) - 1
            full = full[: len(full) - hold] if hold else full
        req.text = full if len(full) >= len(req.text) or reason is not None else req.text
        if reason is not None:
            del req.output_token_ids[k + 1:]  # a token launched after the stop is discarded
            req.num_pending = 0
            self.scheduler.finish(req, reason, stop_reason)
            self.requests.pop(req.request_id, None)

    @staticmethod
    def _output(req: Request, delta: bool = False) -> RequestOutput:
        start = req.num_output_emitted if delta else 0
        end = req.num_output_confirmed
        req.num_output_emitted = end
        comp = CompletionOutput(0, req.text, req.output_token_ids[start:end],
                                req.cumulative_logprob if req.logprobs is not None else None,
                                req.logprobs[start:end] if req.logprobs is not None else None,
                                req.finish_reason, req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp],
                             req.finished, req.prompt_logprobs,
                             RequestMetrics(req.t_arrival, req.t_first_scheduled,
                                            req.t_first_token, req.t_last_token,
                                            req.t_finished, req.num_preemptions),
                             req.num_cached_tokens or 0)
