"""ModelRunner: owns the model, the KV pool, the attention backend and (on CUDA) decode graphs.

Start-up order: resolve the model and its config -> check the (pool, backend, KV dtype, page size,
device) combination (before any weight is loaded) -> load weights -> measure activations ->
size and allocate the pool -> KV scales -> CUDA graphs. ``execute(items)`` runs one step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.registry import backend_class, select_backend
from kvfit.config import EngineConfig
from kvfit.engine import memory
from kvfit.engine.context import Context
from kvfit.engine.guard import check_combination
from kvfit.engine.kv_scales import resolve_scales
from kvfit.errors import KVBudgetError
from kvfit.kvcache.hybrid_swa import (build_hybrid_metadata, hybrid_capacity_line,
                                      solve_hybrid_pages)
from kvfit.kvcache.registry import resolve_pool_class
from kvfit.models import registry as models
from kvfit.models.weights import WeightSink, init_dummy, iter_gguf, iter_safetensors

log = logging.getLogger("kvfit")


@dataclass
class StepResult:
    """Logits of the rows that sample (one per sampling request, batch order) and, for requests
    that asked for prompt logprobs, their per-position log-softmax rows."""

    sample_logits: torch.Tensor  # [N_sample, V] float32
    prompt_rows: dict[int, tuple[int, torch.Tensor]]  # batch index -> (start pos, [n, V] logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig, tokenizer=None):
        t0 = time.monotonic()
        self.config = config
        self.device = config.resolved_device
        self.source = models.resolve_model(config.model)
        if self.source.kind == "config" and config.load_format != "dummy":
            raise ValueError(f"{config.model} is a config.json without weights; add "
                             f"--load-format dummy for random weights")
        self.hf_config = models.load_hf_config(self.source)
        self.model_cls = models.model_class_for(self.hf_config)
        cfg_dtype = getattr(self.hf_config, "dtype", None)  # transformers 5 maps torch_dtype here
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        self.dtype = config.resolved_dtype(cfg_dtype)
        self.kv_format = config.resolved_kv_dtype(self.dtype)
        self.layers = self.model_cls.kv_layer_specs(self.hf_config)
        self.pool_cls = resolve_pool_class(self.layers)
        head_dim = self.layers[0].head_dim
        self.backend_name = select_backend(config.attention_backend, self.device.type,
                                           self.pool_cls.name, self.kv_format.name, head_dim)
        if config.page_size is None:  # the backend's measured default for this KV dtype
            ps = backend_class(self.backend_name).default_page_size(self.kv_format.name, head_dim)
            self.config = config = dataclasses.replace(config, page_size=ps)
        check_combination(self.backend_name, self.pool_cls, self.kv_format, config.page_size,
                          self.device.type, self.layers)
        ctx_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2048)
        self.max_model_len = config.max_model_len or ctx_len
        log.info("model %s (%s), dtype %s, attention backend %s, pool %s, pages of %d",
                 config.model, self.hf_config.model_type, str(self.dtype).replace("torch.", ""),
                 self.backend_name, self.pool_cls.name, config.page_size)

        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.model = self._load_model()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.hybrid_plan = None
        num_pages = self._size_pool(free_before)
        backend_cls = backend_class(self.backend_name)
        k_scales, v_scales = resolve_scales(config.kv_scales, self, self.kv_format, tokenizer)
        extra = self._pool_kwargs(self.kv_format)
        if self.hybrid_plan is not None:
            extra["num_swa_pages"] = self.hybrid_plan.num_swa_pages
        self.pool = self.pool_cls(self.layers, num_pages, config.page_size, self.kv_format,
                                  self.device, k_scales, v_scales, **extra)
        self.backend = backend_cls(self.pool, self.dtype, self.model_cls.sm_scale(self.hf_config),
                                   self.model_cls.logit_softcap_of(self.hf_config))
        self.ctx = Context(self.backend, self.pool, self.dtype)
        if self.hybrid_plan is not None:
            log.info(hybrid_capacity_line(self.hybrid_plan, self.kv_format, self.max_model_len))
        else:
            log.info(memory.capacity_line(num_pages, config.page_size, self.layers,
                                          self.kv_format, self.max_model_len))
        self.graphs = None
        if (self.device.type == "cuda" and not config.enforce_eager
                and backend_cls.supports_cuda_graph):
            from kvfit.engine.cuda_graph import DecodeGraphs

            t = time.monotonic()
            self.graphs = DecodeGraphs(self.model, self.ctx, min(config.cuda_graph_max_bs,
                                                                 config.max_num_seqs),
                                       -(-self.max_model_len // config.page_size), self.device)
            log.info("captured decode CUDA graphs in %.1f s", time.monotonic() - t)
        log.info("model runner built in %.1f s", time.monotonic() - t0)

    # -- start-up -------------------------------------------------------------------------
    def _load_model(self):
        with torch.device(self.device):
            model = self.model_cls(self.hf_config, self.max_model_len)
        model = model.to(self.dtype)
        model.eval()
        if self.config.load_format == "dummy":
            init_dummy(model, self.config.seed)
            return model
        sink = WeightSink(model)
        if self.source.kind == "gguf":
            items = iter_gguf(self.source.path, self.hf_config)
        else:
            items = iter_safetensors(self.source.path)
        with torch.no_grad():
            for name, t in items:
                sink.put(name, t)
        sink.check_complete()
        if hasattr(model, "post_load"):
            model.post_load()
        return model

    def _pool_kwargs(self, fmt) -> dict:
        """The V page layout the backend reads fastest for ``fmt`` (when not the default)."""
        layout = backend_class(self.backend_name).v_layout(fmt.name, self.config.page_size,
                                                           self.layers[0].head_dim)
        return {} if layout == "HND" else {"v_layout": layout}

    def _size_pool(self, free_before: int) -> int:
        c = self.config
        if c.num_pages is not None or c.num_tokens is not None:
            budget = None
        elif self.device.type == "cuda":
            peak = self._profile_activations()
            used = self.weight_bytes + peak
            budget = memory.cuda_budget_bytes(free_before, used, c.memory_ratio)
        else:
            budget = memory.cpu_budget_bytes(c.cpu_kv_space_gib, c.memory_ratio)
        if self.pool_cls.name == "HybridSWAKVCache":
            fixed = c.num_pages if c.num_tokens is None else -(-c.num_tokens // c.page_size)
            self.hybrid_plan = solve_hybrid_pages(budget or 0, self.layers, self.kv_format,
                                                  c.page_size, c.max_num_seqs,
                                                  c.max_num_batched_tokens, num_pages=fixed)
            pages = self.hybrid_plan.num_pages
        else:
            pages = memory.decide_num_pages(self.layers, self.kv_format, c.page_size, budget,
                                            c.num_pages, c.num_tokens)
        capacity = pages * c.page_size
        if self.max_model_len > capacity:
            if c.max_model_len is not None:
                raise KVBudgetError(
                    f"--max-model-len {c.max_model_len} does not fit the KV cache "
                    f"({capacity} tokens of {self.kv_format.name}); the largest that fits is "
                    f"{capacity}: lower --max-model-len, raise --memory-ratio, or use "
                    f"--kv-dtype fp8 to double the tokens")
            log.warning("model context %d > KV capacity %d tokens: max_model_len set to %d",
                        self.max_model_len, capacity, capacity)
            self.max_model_len = capacity
        return pages

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak bytes of one full step of max_num_batched_tokens (a throwaway one-request pool)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ps = self.config.page_size
        pages = -(-n // ps)
        pool = self.pool_cls(self.layers, pages, ps, self.kv_format, self.device,
                             **self._pool_kwargs(self.kv_format))
        be = backend_class(self.backend_name)(pool, self.dtype, self.model_cls.sm_scale(self.hf_config))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        be.plan(build_metadata([n], [n], [list(range(pages))], ps, self.device))
        ids = torch.randint(0, self.hf_config.vocab_size, (n,), device=self.device)
        h = self.model(ids, torch.arange(n, device=self.device), Context(be, pool, self.dtype))
        self.model.compute_logits(h[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del pool, be, h
        torch.cuda.empty_cache()
        return peak

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, items, sample_mask: list[bool], prompt_lp: list[bool]) -> StepResult:
        """Run the model over the step's tokens. ``items`` = [(request, n_new)], mutating nothing
        but the KV pool. ``sample_mask[i]``: request i samples after this step (its chunk ends at
        its last token). ``prompt_lp[i]``: return log-softmax rows for all positions of chunk i."""
        ids, pos, q_lens, kv_lens, tables = [], [], [], [], []
        for req, n in items:
            start = req.num_computed_tokens
            ids.extend(req.token_slice(start, start + n))
            pos.extend(range(start, start + n))
            q_lens.append(n)
            kv_lens.append(start + n)
            tables.append(req.pages)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        bs = len(items)
        if self.graphs is not None and all(q == 1 for q in q_lens) and self.graphs.can_run(bs):
            hidden = self.graphs.run(input_ids, positions, kv_lens, tables)
        else:
            if getattr(self.pool, "windowed", False):
                swa = [self.pool.sliding_pages.table(req.request_id) for req, _ in items]
                meta = build_hybrid_metadata(q_lens, kv_lens, tables, swa, self.config.page_size,
                                             self.pool.window, self.pool.null_page, self.device)
            else:
                meta = build_metadata(q_lens, kv_lens, tables, self.config.page_size, self.device)
            self.backend.plan(meta)
            hidden = self.model(input_ids, positions, self.ctx)
        ends = list(itertools.accumulate(q_lens))  # row after each request's last token
        rows = [ends[i] - 1 for i in range(bs) if sample_mask[i]]
        sample_logits = self.model.compute_logits(hidden[rows]) if rows else torch.empty(0)
        prompt_rows = {}
        offset = 0
        for i, (req, n) in enumerate(items):
            if prompt_lp[i]:
                lp = torch.log_softmax(self.model.compute_logits(hidden[offset:offset + n]), -1)
                prompt_rows[i] = (req.num_computed_tokens, lp)
            offset += n
        return StepResult(sample_logits, prompt_rows)

    @torch.inference_mode()
    def forward_tokens(self, token_ids: list[int], pool, backend) -> torch.Tensor:
        """Hidden states of one sequence prefilled from scratch into a given pool/backend
        (calibration and tests). pool/backend are throwaways owned by the caller."""
        n = len(token_ids)
        pages = list(range(-(-n // pool.page_size)))
        backend.plan(build_metadata([n], [n], [pages], pool.page_size, self.device))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(ids, torch.arange(n, device=self.device),
                          Context(backend, pool, self.dtype))
