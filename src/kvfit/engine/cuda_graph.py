"""CUDA graphs for decode steps: captured once per batch size at start, replayed every step.

``DecodeGraphs`` owns static input buffers (token ids, positions, and the attention metadata
tensors: cu_seqlens_q, kv_lens, block_table, slot_mapping) and one graph per batch size in
``capture_sizes(max_bs)``. A step of bs requests runs the smallest captured size >= bs; padded rows get q_len 1, kv_len 1, a block-table row of page 0 and
slot -1 (nothing stored), and their outputs are dropped. Before every replay the backend is
prepared outside the graph (``backend.prepare_cuda_graph``), which FlashInfer's graph wrappers need
and which fixes our Triton kernels' grid per batch size.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.transfer import to_device

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
        self.kv_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((max_bs, self.max_pages), dtype=torch.int32, device=dev)
        # host mirror of the block table; rows are rewritten only when a request's pages change
        self._host_table = np.zeros((max_bs, self.max_pages), dtype=np.int32)
        self._host_rows: list = [None] * max_bs
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
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
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: bs + 1], kv_lens=self.kv_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:bs],
            q_lens_cpu=[1] * bs, kv_lens_cpu=kv_lens_cpu, num_pages_cpu=num_pages_cpu,
            is_decode=True, num_real_reqs=num_real)

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

    def _stage(self, kv_lens_cpu: list[int], page_tables: list[list[int]]):
        """Host side of a replay: (graph batch, table width, int32 [kv_lens | block table rows],
        int64 slots), all for ``gbs`` rows (padded rows: kv_len 1, page 0, slot -1). Only rows
        whose page list changed are rewritten in the host mirror of the block table."""
        bs = len(kv_lens_cpu)
        gbs = self._size_for(bs)
        ps = self.page_size
        kv = np.ones(gbs, dtype=np.int64)
        kv[:bs] = kv_lens_cpu
        n_pages = -(-kv // ps)  # [gbs]
        width = int(n_pages[:bs].max())
        if width > self.max_pages:
            raise ValueError(f"a request needs {width} pages, graphs were sized for "
                             f"{self.max_pages}")
        table = self._host_table  # [max_bs, max_pages] int32
        for i, pages in enumerate(page_tables):
            row = pages[: n_pages[i]]
            if len(row) < n_pages[i]:
                raise ValueError(f"request {i} has {len(pages)} pages for {kv[i]} tokens")
            if self._host_rows[i] != row:  # list compare: far cheaper than converting rows
                table[i, : len(row)] = row
                self._host_rows[i] = row
        for i in range(bs, gbs):
            if self._host_rows[i] != "pad":
                table[i] = 0
                self._host_rows[i] = "pad"
        ints = np.empty(gbs + gbs * width, dtype=np.int32)  # kv_lens | table[:gbs, :width]
        ints[:gbs] = kv
        ints[gbs:].reshape(gbs, width)[:] = table[:gbs, :width]
        last = kv - 1  # position of each row's new token
        slots = table[np.arange(gbs), last // ps].astype(np.int64) * ps + last % ps
        slots[bs:] = -1
        return gbs, width, ints, slots, n_pages

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_lens_cpu: list[int],
            page_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of ``bs = len(kv_lens_cpu)`` requests -> hidden ``[bs, hidden]``.

        kv_lens_cpu[i] counts request i's tokens after this step (its new token included);
        page_tables[i] lists its pages. Mutates the static buffers and the KV pool. Two
        host->device copies (pinned, non-blocking) and no device->host sync."""
        bs = len(kv_lens_cpu)
        gbs, width, ints, slots, n_pages = self._stage(kv_lens_cpu, page_tables)
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        if gbs > bs:
            self.input_ids[bs:gbs].zero_()
            self.positions[bs:gbs].zero_()
        dev_ints = to_device(ints, self.device)
        self.kv_lens[:gbs].copy_(dev_ints[:gbs])
        self.block_table[:gbs, :width].copy_(dev_ints[gbs:].view(gbs, width))
        self.slot_mapping[:gbs].copy_(to_device(slots, self.device))
        meta = self._meta(gbs, list(kv_lens_cpu) + [1] * (gbs - bs), n_pages.tolist(), bs)
        self.backend.prepare_cuda_graph(meta)
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
