"""CUDA graphs for decode steps: captured once per batch size at start, replayed every step.

``DecodeGraphs`` owns static input buffers (token ids, positions, and the attention metadata
tensors: cu_seqlens_q, kv_lens, block_table, slot_mapping; for a pool whose sliding layers have
a page space of their own, the sliding block table and slot mapping too; for the int4 pool each
row's residual slot) and one graph per batch
size in ``capture_sizes(max_bs)``. A step of bs requests runs the smallest captured size >= bs;
padded rows get q_len 1, kv_len 1, a block-table row of page 0 and slot -1 (nothing stored),
and their outputs are dropped. Before every replay the backend is
prepared outside the graph (``backend.prepare_cuda_graph``), which FlashInfer's graph wrappers need
and which fixes our Triton kernels' grid per batch size.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvfit.attention.base import AttentionMetadata, SlidingTables
from kvfit.engine.graph_staging import DecodeStaging
from kvfit.kvcache.int4_residual import graph_residual_plan
from kvfit.transfer import to_device
from kvfit.kvcache.sliding_pages import FREED, first_live_position

log = logging.getLogger("kvfit")


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 64, 16 to 256, 32 beyond, and ``max_bs`` itself: a decode
    batch pads by at most 1/8 of its size up to 64 and 1/5 up to 256 (vLLM captures every 8)."""
    base = ([1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
            + list(range(288, max_bs + 1, 32)))
    sizes = [s for s in base if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def sliding_rows(sliding, swa_tables: list[list[int]]) -> list[list[int]]:
    """The sliding page lists (``SlidingWindowPages.table`` each) as graph table rows: freed
    entries become the sliding page space's null page (zero-filled, read only under the window
    mask)."""
    null = sliding.null_page
    return [[null if p == FREED else p for p in t] for t in swa_tables]


class DecodeGraphs:
    """Mutates the pool only through replays (which store the step's K/V like an eager step)."""

    def __init__(self, model, ctx, max_bs: int, max_pages_per_req: int, device):
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self.model, self.ctx = model, ctx
        self.backend = ctx.backend
        self.device = torch.device(device)
        self.page_size = ctx.pool.page_size
        self.max_bs = max_bs
        self.max_pages = max(1, max_pages_per_req)
        self.sizes = capture_sizes(max_bs)
        dev = self.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.sliding = ctx.pool.sliding_pages  # SlidingWindowPages or None
        # kv_lens, block table(s), slot mapping(s): views of the staging buffer, one copy per
        # step; a pool whose sliding layers have a page space of their own gets a second table
        self.staging = DecodeStaging(max_bs, self.max_pages, self.page_size, dev,
                                     num_tables=1 if self.sliding is None else 2)
        self.kv_lens = self.staging.kv_lens
        self.block_table = self.staging.block_table
        self.slot_mapping = self.staging.slot_mapping
        # the int4 pool: each row's residual slot (-1: a padding row, which stores nothing)
        self.residual_slots = (None if ctx.pool.residual_slots is None else
                               torch.full((max_bs,), -1, dtype=torch.int32, device=dev))
        # known before any forward; a tensor-parallel rank runs its share of the heads
        self.backend.num_q_heads = getattr(model, "num_q_heads_per_rank",
                                           model.config.num_attention_heads)
        self.backend.init_cuda_graph(max_bs, self.max_pages)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.monotonic()
        self._capture_all()
        self.capture_seconds = time.monotonic() - t0
        log.info("CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s",
                 len(self.sizes), max_bs, self.capture_seconds)

    def _meta(self, bs: int, kv_lens_cpu: list[int], num_pages_cpu: list[int],
              num_real: int) -> AttentionMetadata:
        swa = None
        if self.sliding is not None:
            st = self.staging
            first = [first_live_position(kv - 1, self.sliding.window) // self.page_size
                     for kv in kv_lens_cpu]
            swa = SlidingTables(st.block_tables[1][:bs], st.slot_mappings[1][:bs],
                                num_pages_cpu, first)
        residual = None
        if self.residual_slots is not None:
            residual = graph_residual_plan(self.residual_slots[:bs], bs)
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: bs + 1], kv_lens=self.kv_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs],
            q_lens_cpu=[1] * bs, kv_lens_cpu=kv_lens_cpu, num_pages_cpu=num_pages_cpu,
            is_decode=True, num_real_reqs=num_real, swa=swa, residual=residual)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            meta = self._meta(bs, [1] * bs, [1] * bs, 0)
            self.backend.prepare_cuda_graph(meta)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (compiles kernels, autotunes) off-graph
                self.model.forward(self.input_ids[:bs], self.positions[:bs], self.ctx)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model.forward(self.input_ids[:bs], self.positions[:bs], self.ctx)
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)

    def can_run(self, bs: int) -> bool:
        return 1 <= bs <= self.max_bs

    def _size_for(self, bs: int) -> int:
        for s in self.sizes:
            if s >= bs:
                return s
        raise ValueError(f"decode batch {bs} exceeds the largest captured size {self.max_bs}")

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_lens_cpu: list[int],
            page_tables: list[list[int]],
            swa_tables: list[list[int]] | None = None,
            residual_slots: list[int] | None = None) -> torch.Tensor:
        """One decode step of ``bs = len(kv_lens_cpu)`` requests -> hidden ``[bs, hidden]``.

        kv_lens_cpu[i] counts request i's tokens after this step (its new token included);
        page_tables[i] lists its pages; ``swa_tables[i]`` its sliding page list
        (``SlidingWindowPages.table``, ``FREED`` entries allowed) when the pool has sliding
        pages; ``residual_slots[i]`` its residual slot when the pool is the int4 pool. Mutates
        the static buffers and the KV pool. One host->device copy (pinned, non-blocking;
        ``DecodeStaging``, both page tables in it; the int4 pool's slots a second one) and no
        device->host sync."""
        bs = len(kv_lens_cpu)
        gbs = self._size_for(bs)
        swa = None
        if self.sliding is not None:
            if swa_tables is None:
                raise ValueError("this pool's sliding layers have their own pages: pass "
                                 "swa_tables (pool.sliding_pages.table(request_id) each)")
            swa = sliding_rows(self.sliding, swa_tables)
        _, n_pages, kv_all = self.staging.stage(kv_lens_cpu, page_tables, gbs, swa)
        if self.residual_slots is not None:
            if residual_slots is None or len(residual_slots) != bs:
                raise ValueError("the int4 pool's decode graphs need each request's residual "
                                 "slot (pool.residual_slots.slot(request_id))")
            host = np.full(gbs, -1, dtype=np.int32)
            host[:bs] = residual_slots
            self.residual_slots[:gbs].copy_(to_device(host, self.device), non_blocking=True)
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        if gbs > bs:
            self.input_ids[bs:gbs].zero_()
            self.positions[bs:gbs].zero_()
        meta = self._meta(gbs, kv_all, n_pages, bs)
        self.backend.prepare_cuda_graph(meta)
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]

