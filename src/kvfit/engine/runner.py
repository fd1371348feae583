"""ModelRunner: owns the model, the KV pool, the attention backend and (on CUDA) decode graphs.

Start-up order: the settings (engine/settings.py: model config, dtypes, pool class, backend, page
size, V layout, checked by the guard before any weight is loaded) -> load weights -> measure
activations -> size the pool (engine/pool_budget.py, ``pool_cls.solve_pages``) and allocate it -> KV scales and the KV
transform (K centering calibration, the int8 V rotation folded into the weights at load) -> CUDA
graphs. ``execute(items)`` runs one step.

Tensor parallel (``--tensor-parallel-size N``): rank 0's runner starts the workers
(``parallel/workers.py``), every rank builds its shard with this same code (its heads, its KV
heads in its own pool, the same number of pages on every rank: the smallest any rank's budget
holds), and rank 0's ``execute`` first broadcasts the step (a ``StepPlan``) so that every rank
runs the same forward, collectives in the same order; workers loop in ``serve_steps``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvfit.attention.meta_builder import (RequestLookups, build_metadata, build_step_metadata,
                                          request_lookups, token_positions)
from kvfit.config import EngineConfig
from kvfit.engine.context import Context
from kvfit.engine.kv_calibration import resolve_kv_transform
from kvfit.engine.kv_scales import resolve_scales
from kvfit.engine.pool_budget import one_slot, size_pool
from kvfit.engine.settings import EngineSettings, resolve_settings
from kvfit.models.kv_rotation_fold import fold_v_rotation
from kvfit.models.weights import WeightSink, init_dummy, iter_gguf, iter_safetensors
from kvfit.parallel.state import broadcast_from_driver, tp_group
from kvfit.parallel.step_channel import RankCall
from kvfit.transfer import to_device

log = logging.getLogger("kvfit")


@dataclass
class StepResult:
    """Logits of the rows that sample (one per sampling request, batch order) and, for requests
    that asked for prompt logprobs, their per-position log-softmax rows."""

    sample_logits: torch.Tensor  # [N_sample, V] float32
    prompt_rows: dict[int, tuple[int, torch.Tensor]]  # batch index -> (start pos, [n, V] logprobs)


@dataclass(frozen=True)
class StepPlan:
    """One step as every rank runs it (rank 0 builds it, broadcasts it under tensor
    parallelism): token ids and positions (host, int64 [T] each), the attention lists,
    ``carried`` = [(token index, row of the previous step's sampled ids)] for ids only rank 0's
    device has (broadcast separately), the rows that sample, and (batch index, first row,
    rows, start position) of each chunk that wants prompt logprobs; ``lookups``: the pool's
    per-request bookkeeping (sliding page lists, int4 residual slots) as rank 0's scheduler
    keeps it (None: look it up in this rank's pool)."""

    ids: np.ndarray
    positions: np.ndarray
    q_lens: list
    kv_lens: list
    tables: list
    request_ids: list
    carried: list
    sample_rows: list
    prompt_chunks: list
    lookups: Optional[RequestLookups] = None


class ModelRunner:
    """Owns the model, the KV pool, the attention backend and the decode graphs, all built from one
    ``EngineSettings`` (engine/settings.py). Mutates the pool in ``execute``.

    ``tp_rank``/``init_method``: set by a tensor-parallel worker (``engine/tp_worker.py``); rank 0
    leaves them and starts the workers itself when ``tensor_parallel_size`` > 1."""

    def __init__(self, settings: EngineSettings | EngineConfig, tokenizer=None,
                 tp_rank: int = 0, init_method: Optional[str] = None):
        t0 = time.monotonic()
        if isinstance(settings, EngineConfig):  # callers that hold only a config
            settings = resolve_settings(settings)
        self.workers = None
        self._channel = None
        if settings.tp_size > 1 or tp_group().size > 1:
            settings = self._join_tensor_parallel(settings, tp_rank, init_method)
        try:
            self._build(settings, tokenizer, t0)
        except BaseException:
            self.close()  # rank 0 under tensor parallelism: stop the workers, leave the group
            raise

    def _build(self, settings: EngineSettings, tokenizer, t0: float) -> None:
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
        if hasattr(self.model, "set_decode_gemv"):  # before any CUDA graph is captured
            self.model.set_decode_gemv(config.resolved_decode_gemv)
            if config.resolved_decode_gemv and self.device.type == "cuda":
                log.info("one-token decode steps through the fused GEMV (--decode-gemv %s)",
                         config.decode_gemv)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.sizing = size_pool(self, free_before)
        backend_cls = s.backend_cls
        k_scales, v_scales = resolve_scales(config.kv_scales, self, self.kv_format, tokenizer)
        self.pool = self.pool_cls.from_sizing(self.sizing, self.layers, self.kv_format,
                                              self.device, k_scales, v_scales, s.v_layout)
        self.pool.kv_transform = resolve_kv_transform(self, tokenizer)  # before any store
        self.backend = backend_cls(self.pool, self.dtype, self.model_cls.sm_scale(self.hf_config),
                                   self.model_cls.logit_softcap_of(self.hf_config))
        self.ctx = Context(self.backend, self.pool, self.dtype)
        if tp_group().is_driver:
            log.info(self.sizing.capacity_line(self.kv_format, self.max_model_len,
                                               s.tp_size, s.full_layers))
        self.graphs = None
        if (self.device.type == "cuda" and not config.enforce_eager
                and backend_cls.supports_cuda_graph):
            from kvfit.engine.cuda_graph import DecodeGraphs

            t = time.monotonic()
            self.graphs = DecodeGraphs(self.model, self.ctx, config.resolved_cuda_graph_max_bs,
                                       -(-self.max_model_len // config.page_size), self.device)
            log.info("captured decode CUDA graphs in %.1f s", time.monotonic() - t)
        self.prefill_graphs = self._prefill_graphs(backend_cls)
        log.info("model runner built in %.1f s", time.monotonic() - t0)

    def _prefill_graphs(self, backend_cls):
        """CUDA graphs of short prefill/extend steps (engine/prefill_graph.py), or None: on
        CPU, with --enforce-eager, --cuda-graph-max-prefill-tokens 0, or a backend/pool
        without them (logged)."""
        config = self.config
        if (self.device.type != "cuda" or config.enforce_eager
                or config.cuda_graph_max_prefill_tokens == 0
                or not backend_cls.supports_cuda_graph):
            return None
        from kvfit.engine.prefill_graph import PrefillGraphs, graph_reason

        why = graph_reason(self.backend, self.pool)
        if why is not None:
            log.info("prefill steps run eagerly: %s", why)
            return None
        max_tokens = min(config.cuda_graph_max_prefill_tokens, config.max_num_batched_tokens)
        return PrefillGraphs(self.model, self.ctx, max_tokens,
                             -(-self.max_model_len // config.page_size), self.device)

    # -- tensor parallelism ---------------------------------------------------------------
    def _join_tensor_parallel(self, settings: EngineSettings, rank: int,
                              init_method: Optional[str]) -> EngineSettings:
        """Start the workers (rank 0) and join the group; the settings on this rank's device."""
        from kvfit.parallel.group_init import join_group
        from kvfit.parallel.step_channel import StepChannel
        from kvfit.parallel.workers import WorkerGroup, shut_down

        if tp_group().size > 1:
            raise RuntimeError("a tensor-parallel engine is already running in this process: "
                               "close it (LLM.close()) before building another engine")
        size = settings.tp_size
        if rank == 0:
            self.workers = WorkerGroup(settings.config, size)
            init_method = self.workers.init_method
        try:
            group = join_group(rank, size, init_method, settings.device.type)
        except BaseException:
            if self.workers is not None:
                self.workers.close(5.0)
            raise
        self._channel = StepChannel(group.cpu_group)
        if rank == 0:  # at close(), at garbage collection or at exit, whichever comes first
            self._finalizer = weakref.finalize(self, shut_down, self._channel, self.workers)
        if settings.device.type == "cuda":
            settings = dataclasses.replace(settings, device=torch.device("cuda", rank))
        return settings

    def _send(self, plan: Optional[StepPlan]) -> None:
        """Rank 0: hand the step (None: stop) to the workers; a lost worker raises."""
        self.workers.check()
        self._channel.send(plan)

    def collective_call(self, fn, *args):
        """``fn(runner, *args)`` on every rank (rank 0 hands it to the workers first; ``fn`` a
        module-level function); returns rank 0's result. Without tensor parallelism, a call."""
        if self.workers is not None:
            self._send(RankCall(fn, args))
        return fn(self, *args)

    def serve_steps(self) -> None:
        """A worker's life after start-up: run every step rank 0 sends, until it sends None."""
        from kvfit.parallel.group_init import leave_group

        with torch.inference_mode():
            while True:
                plan = self._channel.recv()
                if plan is None:
                    break
                if isinstance(plan, RankCall):
                    plan.fn(self, *plan.args)
                else:
                    self._run(plan, None)
        leave_group()

    def close(self) -> None:
        """Stop the workers and leave the group (rank 0 under tensor parallelism; a no-op
        otherwise). The runner cannot run steps afterwards."""
        if self.workers is not None:
            self.workers = None
            self._finalizer()

    # -- start-up -------------------------------------------------------------------------
    def _load_model(self):
        with torch.device(self.device):
            model = self.model_cls(self.hf_config, self.max_model_len)
        model = model.to(self.dtype)
        model.eval()
        if self.config.load_format == "dummy":
            init_dummy(model, self.config.seed)
            return self._ready(model)
        sink = WeightSink(model)
        if self.source.kind == "gguf":
            items = iter_gguf(self.source.path, self.hf_config)
        else:  # lazy: each rank reads only its slices
            items = iter_safetensors(self.source.path, lazy=True)
        with torch.no_grad():
            for name, t in items:
                sink.put(name, t)
        sink.check_complete()
        return self._ready(model)

    @staticmethod
    def _ready(model):
        """The model's own post-load step when it has one (e.g. stacking MoE experts)."""
        prepare = getattr(model, "prepare_for_inference", None)
        if prepare is not None:
            prepare()
        return model

    def _fold_kv_rotation(self, model):
        """int8 KV stores V rotated per head: fold H into v_proj/o_proj (mutates the weights)."""
        if self.kv_format.rotate:
            n = fold_v_rotation(model)
            log.info("V Hadamard rotation folded into v_proj/o_proj of %d layers", n)
        return model

    # -- one step -------------------------------------------------------------------------
    def _plan(self, items, sample_mask, prompt_lp, carried) -> StepPlan:
        """The step's host inputs. Token ids of ``carried`` tokens are placeholders here and are
        gathered on the device from the previous step's ids (no device->host sync)."""
        q_lens = [n for _, n in items]
        kv_lens = [req.num_computed_tokens + n for req, n in items]
        ids: list[int] = []
        for req, n in items:  # one slice per request, not per token
            ids.extend(req.token_slice(req.num_computed_tokens, req.num_computed_tokens + n))
        positions = token_positions(np.asarray(q_lens, dtype=np.int64),
                                    np.asarray(kv_lens, dtype=np.int64))
        ends = list(itertools.accumulate(q_lens))  # row after each request's last token
        chunks = []
        for i, (req, n) in enumerate(items):
            if prompt_lp[i]:
                chunks.append((i, ends[i] - n, n, req.num_computed_tokens))
        return StepPlan(np.asarray(ids, dtype=np.int64), positions, q_lens, kv_lens,
                        [req.pages for req, _ in items], [req.request_id for req, _ in items],
                        list(carried[1]) if carried is not None else [],
                        [ends[i] - 1 for i in range(len(items)) if sample_mask[i]], chunks)

    def _inputs(self, plan: StepPlan, prev_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [T] and positions [T] on the device (one host->device copy); carried ids
        gathered from ``prev_ids`` on rank 0 and broadcast to the other ranks."""
        t = len(plan.ids)
        host = np.empty(2 * t, dtype=np.int64)  # token ids | positions
        host[:t] = plan.ids
        host[t:] = plan.positions
        dev = to_device(host, self.device)
        input_ids, positions = dev[:t], dev[t:]
        if plan.carried:
            if prev_ids is not None:
                index = to_device(np.asarray(plan.carried, dtype=np.int64).T.copy(),
                                  self.device)  # [2, n]
                input_ids[index[0]] = prev_ids[index[1]]
            broadcast_from_driver(input_ids)  # the identity with one rank
        return input_ids, positions

    @torch.inference_mode()
    def execute(self, items, sample_mask: list[bool], prompt_lp: list[bool],
                carried=None) -> StepResult:
        """Run the model over the step's tokens. ``items`` = [(request, n_new)], mutating nothing
        but the KV pool. ``sample_mask[i]``: request i samples after this step (its chunk ends at
        its last token). ``prompt_lp[i]``: return log-softmax rows for all positions of chunk i.
        ``carried``: (previous step's device ids [N], [(token index, row)]) for input tokens the
        host has not read yet (overlap scheduling). Launches work; never waits for the GPU
        (under tensor parallelism: after handing the step to the workers)."""
        plan = self._plan(items, sample_mask, prompt_lp, carried)
        return self.run_plan(plan, carried[0] if carried is not None else None)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, prev_ids=None) -> StepResult:
        """Run one step given as a ``StepPlan`` on every rank (rank 0 hands it to the workers
        first). ``execute`` builds the plan from the scheduler's requests; benchmarks build
        their own (synthetic page tables). ``prev_ids``: the previous step's device ids that
        ``plan.carried`` indexes."""
        workers = self.workers
        if workers is None:
            return self._run(plan, prev_ids)
        if plan.lookups is None:  # the workers' pools keep no bookkeeping: send rank 0's
            plan = dataclasses.replace(plan, lookups=request_lookups(self.pool, plan.request_ids))
        workers.in_step = True
        try:
            self._send(plan)
            return self._run(plan, prev_ids)
        except RuntimeError:
            workers.check(wait_s=5.0)  # a collective failed because a worker died
            raise
        finally:
            workers.in_step = False

    def _run(self, plan: StepPlan, prev_ids) -> StepResult:
        """The forward of one step (every rank), logits of the sampling rows and prompt rows."""
        input_ids, positions = self._inputs(plan, prev_ids)
        q_lens, kv_lens = plan.q_lens, plan.kv_lens
        bs = len(q_lens)
        lookups = plan.lookups or request_lookups(self.pool, plan.request_ids)
        if self.graphs is not None and all(q == 1 for q in q_lens) and self.graphs.can_run(bs):
            hidden = self.graphs.run(input_ids, positions, kv_lens, plan.tables,
                                     lookups.swa_tables, lookups.residual_slots)
        elif self.prefill_graphs is not None and self.prefill_graphs.bucket_for(q_lens):
            hidden = self.prefill_graphs.run(input_ids, positions, q_lens, kv_lens, plan.tables)
        else:
            meta = build_step_metadata(self.pool, q_lens, kv_lens, plan.tables,
                                       plan.request_ids, self.device, lookups)
            self.backend.prepare(meta)
            hidden = self.model(input_ids, positions, self.ctx)
        rows = plan.sample_rows
        if not rows:
            sample_logits = torch.empty(0)
        elif len(rows) == hidden.shape[0]:  # decode: every row samples, no gather needed
            sample_logits = self.model.compute_logits(hidden)
        elif rows[-1] - rows[0] + 1 == len(rows):  # consecutive rows (one prompt): a view
            sample_logits = self.model.compute_logits(hidden[rows[0]:rows[-1] + 1])
        else:
            sample_logits = self.model.compute_logits(
                hidden[to_device(np.asarray(rows, dtype=np.int64), self.device)])
        prompt_rows = {}
        for i, first, n, start in plan.prompt_chunks:
            lp = torch.log_softmax(self.model.compute_logits(hidden[first:first + n]), -1)
            prompt_rows[i] = (start, lp)
        return StepResult(sample_logits, prompt_rows)

    @torch.inference_mode()
    def forward_tokens(self, token_ids: list[int], pool, backend) -> torch.Tensor:
        """Hidden states of one sequence prefilled from scratch into a given pool/backend
        (calibration and tests). pool/backend are throwaways owned by the caller. Under tensor
        parallelism every rank must call it with the same ids at the same point (its
        collectives pair up), as the start-up K-mean calibration does."""
        n = len(token_ids)
        pages = list(range(-(-n // pool.page_size)))
        backend.prepare(build_metadata([n], [n], [pages], pool.page_size, self.device,
                                       residual_slots=one_slot(pool)))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(ids, torch.arange(n, device=self.device),
                          Context(backend, pool, self.dtype))
