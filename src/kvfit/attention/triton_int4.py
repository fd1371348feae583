"""The triton backend over the int4 pool (``Int4KVCache``, ``--kv-dtype int4``): store, decode
and prefill of its full-attention layers.

Per step, ``prepare`` (host work only): a decode step picks the int4 decode launch
(kernels/decode_int4.py: split count from the batch and the longest context); any other step
lists the pages its requests read (``PrefillPages``). Per layer, ``forward``:

* store: a decode step in one launch (kernels/int4_store.py: the new row to the residual slot,
  or, when it completes a page, the page quantized into the pool); other steps by the step's
  residual plan (``meta.residual``): the pages that fill are staged (``pool.stage_pages``, their
  earlier tokens from the residual slot) and quantized whole in one launch
  (``int4_store_pages``), the other new tokens go to the residual slot (``pool.store_tail``);
  the same bytes as the torch store, ``pool.store_step``;
* decode (every request has one new token): the int4 decode kernel over the packed pages and
  each request's full-precision residual page, dequantized in registers;
* prefill and mixed steps: each request's pages dequantized into a compact paged cache in the
  compute dtype (full pages from the pool in one launch, kernels/int4_dequant.py; the partial
  page from the residual slot: the values the torch reference attends over), then the 16-bit
  paged prefill kernel over it. This costs a pass over the requests' pages per layer and step.

CUDA graphs: decode steps are captured (``init_cuda_graph``, ``prepare_cuda_graph``): the
store and the decode kernels read the step's lengths, block table and residual slots from static
device buffers, the split count is fixed per batch size from the longest context, and the split
scratch is allocated once. Owns the per-step launch plan and the split scratch; mutates the pool
(stores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvfit.kernels import decode_int4
from kvfit.kernels.decode_int4 import Int4DecodeConfig, choose_config, int4_decode
from kvfit.kernels.int4_dequant import int4_dequant_pages
from kvfit.kernels.int4_store import int4_store_decode, int4_store_pages
from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
from kvfit.transfer import to_device

@dataclass
class PrefillPages:
    """The pages a prefill/mixed step's requests read, as a compact paged cache of ``num_pages``
    pages: pool page ``block_table[full_req, full_col]`` goes to page ``full_dst`` (dequantized),
    residual slot ``part_slot`` to page ``part_dst``; ``table [B, width]`` int32 maps each
    request's logical pages to the compact ones (device tensors)."""

    full_req: torch.Tensor
    full_col: torch.Tensor
    full_dst: torch.Tensor
    part_slot: torch.Tensor
    part_dst: torch.Tensor
    table: torch.Tensor
    num_pages: int

    @classmethod
    def plan(cls, kv_lens: list[int], slots: list[int], page_size: int,
             device: torch.device) -> "PrefillPages":
        """Host lists -> one host->device copy. ``slots[i] < 0``: a padding row (reads nothing)."""
        full, part, rows = [], [], []
        at = 0
        for i, (kv, slot) in enumerate(zip(kv_lens, slots)):
            if slot < 0 or kv <= 0:
                rows.append(np.zeros(0, np.int64))
                continue
            nfull, tail = divmod(int(kv), page_size)
            cols = np.arange(nfull, dtype=np.int64)
            full.append(np.stack([np.full_like(cols, i), cols, at + cols]))
            if tail:
                part.append(np.array([[slot], [at + nfull]], dtype=np.int64))
            n = nfull + (1 if tail else 0)
            rows.append(at + np.arange(n, dtype=np.int64))
            at += n
        width = max(1, max(len(r) for r in rows))
        table = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            table[i, :len(r)] = r
        f = np.concatenate(full, axis=1) if full else np.zeros((3, 0), np.int64)
        p = np.concatenate(part, axis=1) if part else np.zeros((2, 0), np.int64)
        nf, npart = f.shape[1], p.shape[1]
        flat = np.concatenate([f.reshape(-1), p.reshape(-1), table.reshape(-1)])
        dev = to_device(np.ascontiguousarray(flat), device)
        f_dev = dev[:3 * nf].view(3, nf)
        p_dev = dev[3 * nf:3 * nf + 2 * npart].view(2, npart)
        t_dev = dev[3 * nf + 2 * npart:].view(len(rows), width).to(torch.int32)
        return cls(f_dev[0], f_dev[1], f_dev[2], p_dev[0], p_dev[1], t_dev, max(1, at))

    def gather(self, pool, layer_id: int, block_table: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[num_pages, Hkv, P, D]`` in ``dtype``: the step's pages of layer ``layer_id``
        dequantized (rows past a request's length in its partial page are stale: the prefill
        kernel masks them)."""
        _, h, p, half = pool.k_caches[layer_id].shape
        shape = (self.num_pages, h, p, 2 * half)
        k = torch.empty(shape, dtype=dtype, device=block_table.device)
        v = torch.empty_like(k)
        if self.full_dst.numel():  # one launch (kernels/int4_dequant.py)
            int4_dequant_pages(pool, layer_id, block_table[self.full_req, self.full_col],
                               self.full_dst, k, v)
        if self.part_dst.numel():
            k[self.part_dst] = pool.k_residual[layer_id][self.part_slot].to(dtype)
            v[self.part_dst] = pool.v_residual[layer_id][self.part_slot].to(dtype)
        return k, v


class TritonInt4:
    """The int4 path of ``TritonBackend`` (attention/triton_backend.py delegates to it)."""

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        if logit_softcap is not None:
            raise ValueError("the triton int4 kernels have no logit soft-cap: run this model's "
                             "int4 KV with --attention-backend torch, or choose another "
                             "--kv-dtype")
        self.pool = pool
        self.compute_dtype = compute_dtype
        self.sm_scale = sm_scale
        self.meta = None
        self._decode_cfg: Optional[Int4DecodeConfig] = None
        self._pages: Optional[PrefillPages] = None
        self._prefill_cfg = None
        self._blocks: dict[int, torch.Tensor] = {}
        self._graph_max_len: Optional[int] = None
        self._scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        dev = torch.device(pool.device)
        self._num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                         if dev.type == "cuda" else 132)
        # decode through the Gluon kernel (decode_int4.GLUON) where it runs: Hopper, 16-bit
        # compute and residual
        self._gluon = (decode_int4.GLUON and dev.type == "cuda"
                       and compute_dtype in (torch.bfloat16, torch.float16)
                       and pool.residual_dtype == compute_dtype
                       and decode_int4.gluon_available(dev))

    def _config(self, batch: int, max_len: int) -> Int4DecodeConfig:
        spec = self.pool.layers[0]
        return choose_config(batch, spec.num_kv_heads, spec.head_dim, max_len, self._num_sms,
                             gluon=self._gluon, v_t=self.pool.v_layout == "HDN")

    def prepare(self, meta) -> None:
        """Mutates self: the step's metadata and launch plan. Host work only (no syncs)."""
        if meta.residual is None:
            raise RuntimeError(f"the {self.pool.name} pool stores through a residual plan: build "
                               "the step's metadata with build_step_metadata (or "
                               "build_metadata(..., residual_slots=...))")
        self.meta = meta
        spec = self.pool.layers[0]
        if meta.is_decode:
            self._decode_cfg = self._config(meta.batch_size, max(meta.kv_lens_cpu, default=1))
            self._pages = None
            return
        self._pages = PrefillPages.plan(meta.kv_lens_cpu, meta.residual.slots_cpu,
                                        self.pool.page_size, meta.cu_seqlens_q.device)
        self._prefill_cfg = prefill_config(spec.head_dim, self.compute_dtype, self.compute_dtype)
        self._blocks = {}

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int, num_q_heads: int) -> None:
        """Allocate the split scratch for ``max_bs`` decode rows at the most splits any batch
        size gets with contexts up to ``max_pages_per_req`` pages (static across replays)."""
        spec = self.pool.layers[0]
        self._graph_max_len = max_pages_per_req * self.pool.page_size
        most = max(bs * self._config(bs, self._graph_max_len).num_splits
                   for bs in range(1, max_bs + 1))
        dev = self.pool.device
        rows = most * num_q_heads
        self._scratch = (torch.empty((rows, spec.head_dim), dtype=torch.float32, device=dev),
                         torch.empty((rows,), dtype=torch.float32, device=dev))

    def prepare_cuda_graph(self, meta) -> None:
        """``prepare`` for a graph decode step: the split count fixed by the batch size."""
        if self._graph_max_len is None:
            raise RuntimeError("init_cuda_graph must be called before prepare_cuda_graph")
        self.meta = meta
        self._decode_cfg = self._config(meta.batch_size, self._graph_max_len)
        self._pages = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_id: int) -> torch.Tensor:
        """Stores k/v (quantizing pages that fill), then attends. q ``[T, Hq, D]``."""
        meta, pool = self.meta, self.pool
        tf = pool.kv_transform
        if tf is not None:  # none is calibrated for int4 today; applied as the reference does
            q, k = tf.transform_qk(layer_id, q, k)
        if meta.is_decode:  # one token per request: one launch (kernels/int4_store.py)
            k = k if k.stride(-1) == 1 else k.contiguous()
            v = v if v.stride(-1) == 1 else v.contiguous()
            int4_store_decode(pool, layer_id, k, v, meta.block_table, meta.kv_lens,
                              meta.residual.slots)
        else:  # pages that fill: staged (torch), quantized in one launch; then the tail
            staged = pool.stage_pages(layer_id, k, v, meta.residual)
            if staged is not None:
                int4_store_pages(pool, layer_id, *staged, meta.residual.full_pages)
            pool.store_tail(layer_id, k, v, meta.residual)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        if meta.is_decode:
            scratch = None  # the static split scratch when it is large enough
            n = q.shape[0] * q.shape[1] * self._decode_cfg.num_splits
            if self._scratch is not None and n <= self._scratch[1].shape[0]:
                scratch = self._scratch
            return int4_decode(q, pool, layer_id, meta.block_table, meta.kv_lens,
                               meta.residual.slots, out, self.sm_scale, self._decode_cfg,
                               scratch)
        kc, vc = self._pages.gather(pool, layer_id, meta.block_table, q.dtype)
        group = q.shape[1] // kc.shape[1]
        if group not in self._blocks:
            self._blocks[group] = order_prefill_blocks(
                meta.q_lens_cpu, group, self._prefill_cfg.block_m, meta.cu_seqlens_q.device,
                meta.kv_lens_cpu)
        return paged_prefill(q, kc, vc, self._pages.table, meta.cu_seqlens_q, meta.kv_lens,
                             self._blocks[group], self._prefill_cfg, out, self.sm_scale)
