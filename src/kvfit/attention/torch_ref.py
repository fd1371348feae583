"""The torch reference backend: the oracle every kernel is tested against. CPU and CUDA.

For each request it gathers the request's pages, dequantizes them to the compute dtype (applying
the per-tensor scale), and runs explicit softmax attention with a causal mask that accounts for
the cached prefix: query j of a request with q_len new tokens and kv_len cached tokens sits at
absolute position ``kv_len - q_len + j`` and sees keys ``0 .. kv_len - q_len + j`` (and, on a
sliding-window layer, only the last ``window`` of those).

K centering and rotation (``pool.kv_transform``, kvcache/kv_transform.py) are applied to q and k
after RoPE, before the store: the pool then holds (k - mean) @ H, attention runs on q @ H, and on
a soft-capped layer ``sm_scale * q . mean`` is added back to each logit row before the cap.
"""

from __future__ import annotations

import torch

from kvfit.attention.base import AttentionBackend
from kvfit.attention.torch_attend import attend
from kvfit.attention.torch_mla import TorchMLAMixin
from kvfit.kvcache.dtypes import KV_FORMATS


class TorchRefBackend(TorchMLAMixin, AttentionBackend):
    name = "torch"
    devices = frozenset({"cpu", "cuda"})
    pools = frozenset({"MHAKVCache", "HybridSWAKVCache", "MLAKVCache", "Int4KVCache"})
    kv_dtypes = frozenset(KV_FORMATS)
    page_sizes = None
    head_dims = None
    supports_cuda_graph = False
    kv_transforms = frozenset({"k_mean", "rotate"})

    def forward(self, q, k, v, layer_id):
        meta = self.meta
        out = torch.empty_like(q)
        shift = None
        tf = self.pool.kv_transform
        if tf is not None:
            if self.logit_softcap is not None:
                shift = tf.logit_shift(layer_id, q)
                shift = None if shift is None else shift * self.sm_scale  # [T, Hq]
            q, k = tf.transform_qk(layer_id, q, k)
        spec = self.pool.layers[layer_id]
        window = spec.window if spec.kind == "sliding" else None
        slots, table, num_pages = meta.slot_mapping, meta.block_table, meta.num_pages_cpu
        first_live = None
        if window is not None and self.pool.sliding_pages is not None:
            # sliding layers live in their own page space (see kvcache/hybrid_swa.py)
            swa = meta.swa
            if swa is None:
                raise RuntimeError(f"the {self.pool.name} pool keeps sliding layers in their own "
                                   "page space: build the step's metadata with "
                                   "kvfit.attention.meta_builder.build_step_metadata (or "
                                   "build_hybrid_metadata)")
            slots, table, num_pages, first_live = (swa.slot_mapping, swa.block_table,
                                                    swa.num_pages_cpu, swa.first_live_cpu)
        plan = meta.residual  # int4: full pages quantized, partial pages in residual slots
        if plan is not None:
            self.pool.store_step(layer_id, k, v, plan)
        elif self.pool.residual_slots is not None:
            raise RuntimeError(f"the {self.pool.name} pool stores through a residual plan: build "
                               "the step's metadata with build_step_metadata (or "
                               "build_metadata(..., residual_slots=...))")
        else:
            self.pool.store_kv(layer_id, k, v, slots)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
            if q_len == 0:
                continue
            first = 0 if first_live is None else first_live[i]  # gather only the live window
            pages = table[i, first: num_pages[i]]
            offset = first * self.pool.page_size
            extra = {} if plan is None else {"residual_slot": plan.slots_cpu[i]}
            kk, vv = self.pool.gather_kv(layer_id, pages, kv_len - offset, self.compute_dtype,
                                         **extra)
            out[start:start + q_len] = attend(
                q[start:start + q_len], kk, vv, self.sm_scale, window=window,
                softcap=self.logit_softcap, key_offset=offset,
                logit_shift=None if shift is None else shift[start:start + q_len])
            start += q_len
        return out

