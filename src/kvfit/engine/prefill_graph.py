"""CUDA graphs for short prefill/extend steps: one graph per token bucket, captured at start.

A step of up to ``max_tokens`` tokens in up to ``MAX_REQS`` requests (an extend of a cached
prefix, a short prompt, a mixed step of a prompt chunk and a few decode tokens) is host bound
when run eagerly: ~10 launches per layer, most of them Triton kernels whose Python launch path
costs tens of microseconds, while the GPU work of a 128-token extend is a few milliseconds at
most. ``PrefillGraphs`` replays the whole forward instead.

Each bucket's graph runs a fixed grid: the prefill kernel over ``max_prefill_blocks(bucket,
MAX_REQS)`` programs (and as many key splits, ``kernels/prefill_split.py``), the token-minor V
store over ``max_store_chunks`` chunks; the step's program lists sit in static buffers with
spare entries of request -1, whose programs exit. Padded tokens store nothing (slot -1) and
their rows are dropped. Metadata goes in one pinned host->device copy (``PrefillStaging``).
The tokens equal the eager step's: the same kernels, the same program list, and the key
split's partition depends on each block only.
"""

from __future__ import annotations

import logging
import time

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.engine.graph_segments import SegmentedGraph, capture_segmented, segment_starts
from kvfit.engine.prefill_staging import PrefillStaging

log = logging.getLogger("kvfit")

MAX_REQS = 8  # requests per prefill graph: an extend or two, a few decode tokens beside them


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets 16, 32, 64, ... up to ``max_tokens`` (itself included): a step pads by
    less than 2x, and below 16 tokens the step's time does not depend on its size."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


def graph_reason(backend, pool) -> str | None:
    """Why prefill graphs cannot run over this backend and pool, or None when they can."""
    if not getattr(backend, "supports_prefill_graph", False):
        return f"the {backend.name} backend has no prefill graphs"
    if "mla" in pool.layer_kinds:
        return "MLA pools run prefill eagerly"
    if pool.sliding_pages is not None:
        return "sliding layers with a page space of their own run prefill eagerly"
    if pool.residual_slots is not None:
        return "the int4 pool's residual store runs prefill eagerly"
    return None


class PrefillGraphs:
    """Owns the static inputs, metadata buffers and one CUDA graph per token bucket. Mutates
    the KV pool only through replays (which store the step's K/V like an eager step)."""

    def __init__(self, model, ctx, max_tokens: int, max_pages_per_req: int, device):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model, self.ctx = model, ctx
        self.backend = backend = ctx.backend
        pool = ctx.pool
        why = graph_reason(backend, pool)
        if why is not None:
            raise ValueError(f"prefill CUDA graphs: {why}")
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.sizes = prefill_buckets(max_tokens)
        hq = getattr(model, "num_q_heads_per_rank", model.config.num_attention_heads)
        self.group = hq // pool.layers[0].num_kv_heads
        backend.num_q_heads = hq
        backend.init_prefill_graph(max_tokens, hq)
        self.v_t = pool.v_layout == "HDN"
        self.staging = PrefillStaging(max_tokens, MAX_REQS, max(1, max_pages_per_req),
                                      pool.page_size, self.group,
                                      backend.prefill_graph_block_m(), self.device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.graphs: dict[int, SegmentedGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.monotonic()
        self._capture_all()
        self.capture_seconds = time.monotonic() - t0
        log.info("CUDA graphs: captured %d prefill token buckets (%d..%d tokens, up to %d "
                 "requests, %d linked graphs each) in %.1f s", len(self.sizes), self.sizes[0],
                 max_tokens, MAX_REQS, self.links, self.capture_seconds)

    def _meta(self, bucket: int, q_lens: list[int], kv_lens: list[int], n_pages: list[int],
              num_real: int) -> AttentionMetadata:
        st = self.staging
        return AttentionMetadata(
            cu_seqlens_q=st.cu_seqlens, kv_lens=st.kv_lens, block_table=st.block_table,
            slot_mapping=st.slot_mapping[:bucket], q_lens_cpu=q_lens, kv_lens_cpu=kv_lens,
            num_pages_cpu=n_pages, is_decode=False, num_real_reqs=num_real)

    def _prepare(self, meta: AttentionMetadata, bucket: int) -> None:
        nb, nc = self.staging.grid(bucket)
        self.backend.prepare_prefill_graph(meta, self.staging.blocks[:nb],
                                           self.staging.chunks[:nc], self.group)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        zeros = [0] * MAX_REQS
        # a chain of graphs cut at layer boundaries: the GPU starts after the first link's
        # launch instead of the whole graph's (engine/graph_segments.py)
        layers = getattr(getattr(self.model, "model", None), "layers", None) or []
        starts = segment_starts(len(layers))
        self.links = len(starts) + 1
        for bucket in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            # the buffers hold spare programs only and slots -1: the capture stores nothing
            self._prepare(self._meta(bucket, zeros, zeros, zeros, 0), bucket)
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (compiles kernels) off-graph
                self.model.forward(ids, pos, self.ctx)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            chain, out = capture_segmented(lambda: self.model.forward(ids, pos, self.ctx),
                                           layers, starts, pool, stream)
            self.graphs[bucket] = chain
            self.outputs[bucket] = out
        torch.cuda.synchronize(self.device)

    def bucket_for(self, q_lens: list[int]) -> int | None:
        """The bucket a step of these new-token counts replays, or None (run it eagerly)."""
        if not q_lens or len(q_lens) > MAX_REQS:
            return None
        t = sum(q_lens)
        for s in self.sizes:
            if s >= t:
                return s
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, q_lens: list[int],
            kv_lens: list[int], page_tables: list[list[int]]) -> torch.Tensor:
        """One step (``bucket_for(q_lens)`` not None) -> hidden ``[T, hidden]`` of its ``T =
        sum(q_lens)`` tokens (a view of the graph's output, valid until the next replay).

        kv_lens[i] counts request i's tokens after this step; page_tables[i] lists its pages.
        Mutates the static buffers and the KV pool. One host->device copy of metadata, two
        device copies of the inputs, no device->host sync."""
        bucket = self.bucket_for(q_lens)
        if bucket is None:
            raise ValueError(f"a step of {len(q_lens)} requests / {sum(q_lens)} tokens has no "
                             f"prefill graph (up to {MAX_REQS} requests, {self.max_tokens} "
                             f"tokens)")
        t, b = sum(q_lens), len(q_lens)
        n_pages = self.staging.stage(q_lens, kv_lens, page_tables, bucket, self.v_t)
        self.input_ids[:t].copy_(input_ids)  # padded rows keep earlier (valid) ids/positions
        self.positions[:t].copy_(positions)
        pad = [0] * (MAX_REQS - b)
        self._prepare(self._meta(bucket, list(q_lens) + pad, list(kv_lens) + pad, n_pages, b),
                      bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:t]
