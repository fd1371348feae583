"""The triton backend's MLA half: weight-absorbed attention over the ``MLAKVCache`` latent pool
with our kernels (kernels/mla.py). ``TritonBackend`` builds one ``TritonMLA`` when its pool holds
MLA layers and hands it ``prepare``, ``forward_mla`` and the CUDA-graph hooks.

Interface (as attention/torch_mla.py): ``forward_mla(q [T, H, slab], kv [T, slab], layer_id,
v_dim) -> [T, H, v_dim]``: stores the step's slabs (quantize on store, one launch), then decode
(split-K, every head of a request in one program) or prefill/extend (causal over the cached
prefix; decode tokens of a mixed batch are requests with one new token).

Launch choices depend on the head count and rank, known at the first forward: decode configs
are a pure function of (batch, longest context, heads, rank), so a CUDA graph captured for a
batch size replays with the same grid (``prepare_cuda_graph`` fixes the context to the graphs'
largest); split scratch is allocated per call (inside a capture: from the graph's pool).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.kernels.mla import (decode_config, describe_decode, mla_decode, mla_prefill,
                               order_mla_blocks, prefill_config, store_latent)

log = logging.getLogger("kvfit")


class TritonMLA:
    """Owns the step's MLA launch plan; mutates the pool's latent caches in ``forward_mla``."""

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        if logit_softcap is not None:
            raise ValueError("the triton MLA kernels have no logit soft-capping; use "
                             "--attention-backend torch for such a model")
        self.pool = pool
        self.compute_dtype = compute_dtype
        self.sm_scale = sm_scale
        self.meta: Optional[AttentionMetadata] = None
        self._told = False
        self._max_len = 1
        self._graph_max_len: Optional[int] = None
        self._blocks: Optional[torch.Tensor] = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Host work only: the step's metadata and longest context. Mutates self."""
        self.meta = meta
        self._max_len = max(meta.kv_lens_cpu, default=1)
        self._blocks = None

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        self._graph_max_len = max_pages_per_req * self.pool.page_size

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """As ``prepare`` for a decode batch, with the context fixed to the graphs' largest."""
        if self._graph_max_len is None:
            raise RuntimeError("init_cuda_graph must be called before prepare_cuda_graph")
        self.prepare(meta)
        self._max_len = self._graph_max_len

    @functools.cache
    def _decode_cfg(self, batch: int, max_len: int, heads: int, rank: int, rope: int):
        return decode_config(batch, heads, rank, max_len, self.pool.dtype, self.compute_dtype,
                             rope=rope)

    def forward_mla(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int,
                    v_dim: int) -> torch.Tensor:
        """Store ``kv`` and attend (see module docstring). Mutates the pool."""
        meta, pool = self.meta, self.pool
        cache, scale = pool.kv_caches[layer_id], pool.k_scales[layer_id]
        store_latent(kv, cache, meta.slot_mapping, pool.fmt, scale)
        if q.stride(-1) != 1:
            q = q.contiguous()
        t, h, slab = q.shape
        out = q.new_empty(t, h, v_dim)
        if meta.is_decode:
            cfg = self._decode_cfg(t, self._max_len, h, v_dim, slab - v_dim)
            if not self._told:  # once: which decode kernel this pool runs
                self._told = True
                log.info("MLA decode: %s", describe_decode(cfg, pool.dtype))
            return mla_decode(q, cache, meta.block_table, meta.cu_seqlens_q, meta.kv_lens, out,
                              v_dim, self.sm_scale, cfg, scale)
        cfg = prefill_config(h, pool.dtype, self.compute_dtype)
        if self._blocks is None:  # once per step (every layer has the same rows)
            real = meta.batch_size if meta.num_real_reqs is None else meta.num_real_reqs
            self._blocks = order_mla_blocks(meta.q_lens_cpu[:real], meta.kv_lens_cpu[:real], h,
                                            cfg.block_m, q.device)
        return mla_prefill(q, cache, meta.block_table, meta.cu_seqlens_q, meta.kv_lens,
                           self._blocks, out, v_dim, self.sm_scale, cfg, scale)
