"""ModelRunner: owns the model, the KV pool, the attention backend and (on CUDA) decode graphs.

Start-up order: the settings (engine/settings.py: model config, dtypes, pool class, backend, page
size, V layout, checked by the guard before any weight is loaded) -> load weights -> measure
activations -> size the pool (``pool_cls.solve_pages``) and allocate it -> KV scales and the KV
transform (K centering calibration, the int8 V rotation folded into the weights at load) -> CUDA
graphs. ``execute(items)`` runs one step.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvfit.attention.meta_builder import build_metadata, build_step_metadata, token_positions
from kvfit.config import EngineConfig
from kvfit.engine import memory
from kvfit.engine.context import Context
from kvfit.engine.kv_calibration import resolve_kv_transform
from kvfit.engine.kv_scales import resolve_scales
from kvfit.engine.settings import EngineSettings, resolve_settings
from kvfit.errors import KVBudgetError
from kvfit.kvcache.sizing import PoolSizing
from kvfit.models.kv_rotation_fold import fold_v_rotation
from kvfit.models.weights import WeightSink, init_dummy, iter_gguf, iter_safetensors
from kvfit.transfer import to_device

log = logging.getLogger("kvfit")


def _one_slot(pool):
    """A throwaway one-request pool's residual slots (int4: slot 0), None for other pools."""
    return None if pool.residual_slots is None else [0]


@dataclass
class StepResult:
    """Logits of the rows that sample (one per sampling request, batch order) and, for requests
    that asked for prompt logprobs, their per-position log-softmax rows."""

    sample_logits: torch.Tensor  # [N_sample, V] float32
    prompt_rows: dict[int, tuple[int, torch.Tensor]]  # batch index -> (start pos, [n, V] logprobs)


class ModelRunner:
    """Owns the model, the KV pool, the attention backend and the decode graphs, all built from one
    ``EngineSettings`` (engine/settings.py). Mutates the pool in ``execute``."""

    def __init__(self, settings: EngineSettings | EngineConfig, tokenizer=None):
        t0 = time.monotonic()
        if isinstance(settings, EngineConfig):  # callers that hold only a config
            settings = resolve_settings(settings)
        self.settings = s = settings
        self.config = config = s.config  # page_size resolved
        self.device = s.device
        self.source, self.hf_config, self.model_cls = s.source, s.hf_config, s.model_cls
        self.dtype, self.kv_format, self.layers = s.dtype, s.kv_format, list(s.layers)
        self.pool_cls, self.backend_name = s.pool_cls, s.backend_name
        self.max_model_len = s.max_model_len
        log.info("model %s (%s): %s", config.model, self.hf_config.model_type, s.describe())

        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.model = self._fold_kv_rotation(self._load_model())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.sizing = self._size_pool(free_before)
        backend_cls = s.backend_cls
        k_scales, v_scales = resolve_scales(config.kv_scales, self, self.kv_format, tokenizer)
        self.pool = self.pool_cls.from_sizing(self.sizing, self.layers, self.kv_format,
                                              self.device, k_scales, v_scales, s.v_layout)
        self.pool.kv_transform = resolve_kv_transform(self, tokenizer)  # before any store
        self.backend = backend_cls(self.pool, self.dtype, self.model_cls.sm_scale(self.hf_config),
                                   self.model_cls.logit_softcap_of(self.hf_config))
        self.ctx = Context(self.backend, self.pool, self.dtype)
        log.info(self.sizing.capacity_line(self.kv_format, self.max_model_len))
        self.graphs = None
        if (self.device.type == "cuda" and not config.enforce_eager
                and backend_cls.supports_cuda_graph):
            from kvfit.engine.cuda_graph import DecodeGraphs

            t = time.monotonic()
            self.graphs = DecodeGraphs(self.model, self.ctx, config.resolved_cuda_graph_max_bs,
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
        return model

    def _fold_kv_rotation(self, model):
        """int8 KV stores V rotated per head: fold H into v_proj/o_proj (mutates the weights)."""
        if self.kv_format.rotate:
            n = fold_v_rotation(model)
            log.info("V Hadamard rotation folded into v_proj/o_proj of %d layers", n)
        return model

    def _size_pool(self, free_before: int) -> PoolSizing:
        """The pool's size from the memory budget (or the page flags); lowers ``max_model_len``
        to the capacity when the model's context does not fit, refuses an explicit one."""
        c = self.config
        if c.num_pages is not None or c.num_tokens is not None:
            budget = None
        elif self.device.type == "cuda":
            peak = self._profile_activations()
            used = self.weight_bytes + peak
            budget = memory.cuda_budget_bytes(free_before, used, c.memory_ratio)
        else:
            budget = memory.cpu_budget_bytes(c.cpu_kv_space_gib, c.memory_ratio)
        self.kv_budget_bytes = budget  # None when --num-pages/--num-tokens fix the pool
        sizing = self.pool_cls.solve_pages(self.layers, self.kv_format, c.page_size,
                                           self.settings.sizing_limits(budget))
        capacity = sizing.tokens
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
        return sizing

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak bytes of one full step of max_num_batched_tokens (a throwaway one-request pool)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ps = self.config.page_size
        pages = -(-n // ps)
        pool = self.pool_cls(self.layers, pages, ps, self.kv_format, self.device,
                             v_layout=self.settings.v_layout)
        be = self.settings.backend_cls(pool, self.dtype, self.model_cls.sm_scale(self.hf_config))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        be.prepare(build_metadata([n], [n], [list(range(pages))], ps, self.device,
                                  residual_slots=_one_slot(pool)))
        ids = torch.randint(0, self.hf_config.vocab_size, (n,), device=self.device)
        h = self.model(ids, torch.arange(n, device=self.device), Context(be, pool, self.dtype))
        self.model.compute_logits(h[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del pool, be, h
        torch.cuda.empty_cache()
        return peak

    # -- one step -------------------------------------------------------------------------
    def _step_inputs(self, items, carried) -> tuple[torch.Tensor, torch.Tensor, list, list, list]:
        """Token ids [T] and positions [T] on the device (one host->device copy), plus the host
        lists q_lens, kv_lens and page tables. ``carried`` = (device ids of the previous step,
        [(token index here, row there)]): those input tokens are placeholders on the host and
        are gathered on the device instead (no device->host sync)."""
        q_lens = [n for _, n in items]
        kv_lens = [req.num_computed_tokens + n for req, n in items]
        tables = [req.pages for req, _ in items]
        ids: list[int] = []
        for req, n in items:  # one slice per request, not per token
            ids.extend(req.token_slice(req.num_computed_tokens, req.num_computed_tokens + n))
        t = len(ids)
        host = np.empty(2 * t, dtype=np.int64)  # token ids | positions
        host[:t] = ids
        host[t:] = token_positions(np.asarray(q_lens, dtype=np.int64),
                                   np.asarray(kv_lens, dtype=np.int64))
        dev = to_device(host, self.device)
        input_ids, positions = dev[:t], dev[t:]
        if carried is not None and carried[1]:
            prev_ids, pairs = carried
            index = to_device(np.asarray(pairs, dtype=np.int64).T.copy(), self.device)  # [2, n]
            input_ids[index[0]] = prev_ids[index[1]]
        return input_ids, positions, q_lens, kv_lens, tables

    @torch.inference_mode()
    def execute(self, items, sample_mask: list[bool], prompt_lp: list[bool],
                carried=None) -> StepResult:
        """Run the model over the step's tokens. ``items`` = [(request, n_new)], mutating nothing
        but the KV pool. ``sample_mask[i]``: request i samples after this step (its chunk ends at
        its last token). ``prompt_lp[i]``: return log-softmax rows for all positions of chunk i.
        ``carried``: (previous step's device ids [N], [(token index, row)]) for input tokens the
        host has not read yet (overlap scheduling). Launches work; never waits for the GPU."""
        input_ids, positions, q_lens, kv_lens, tables = self._step_inputs(items, carried)
        bs = len(items)
        if self.graphs is not None and all(q == 1 for q in q_lens) and self.graphs.can_run(bs):
            hidden = self.graphs.run(input_ids, positions, kv_lens, tables)
        else:
            meta = build_step_metadata(self.pool, q_lens, kv_lens, tables,
                                       [req.request_id for req, _ in items], self.device)
            self.backend.prepare(meta)
            hidden = self.model(input_ids, positions, self.ctx)
        ends = list(itertools.accumulate(q_lens))  # row after each request's last token
        rows = [ends[i] - 1 for i in range(bs) if sample_mask[i]]
        if not rows:
            sample_logits = torch.empty(0)
        elif len(rows) == hidden.shape[0]:  # decode: every row samples, no gather needed
            sample_logits = self.model.compute_logits(hidden)
        else:
            sample_logits = self.model.compute_logits(
                hidden[to_device(np.asarray(rows, dtype=np.int64), self.device)])
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
        backend.prepare(build_metadata([n], [n], [pages], pool.page_size, self.device,
                                       residual_slots=_one_slot(pool)))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(ids, torch.arange(n, device=self.device),
                          Context(backend, pool, self.dtype))
