"""The ``fi`` attention backend: FlashInfer's paged kernels over the MHAKVCache pool (HND pages)
and, through ``attention/flashinfer_mla.py``, its MLA kernels over the MLAKVCache latent pool.

Per step ``prepare`` translates ``AttentionMetadata`` into FlashInfer's page lists (indptr, indices,
last page lengths, built from the host lists plus one device gather of the block table: no host
sync) and plans one FlashInfer wrapper (FlashInfer's own ``wrapper.plan``):
- decode steps (every request has one new token): ``BatchDecodeWithPagedKVCacheWrapper``, with
  tensor cores when a KV head serves >= 4 query heads (where the padded MMA pays);
- any other step, mixed ones included: ``BatchPrefillWithPagedKVCacheWrapper`` (fa2; FlashInfer
  0.7.2's fa3 prefill does not build with fp8 KV) for the whole flat batch, decode tokens being
  requests of q_len 1. One wrapper per step keeps one FlashInfer plan per step.
``q_data_type`` is the compute dtype, ``kv_data_type`` the pool dtype; per-layer K/V scales go to
``run(k_scale=, v_scale=)``, which folds k_scale into sm_scale and multiplies the output by v_scale.
New K/V are stored first by our fused Triton store kernel (quantize with saturation and scale).

CUDA graphs: one decode wrapper per captured batch size with static index buffers
(``use_cuda_graph=True``); ``prepare_cuda_graph`` plans it outside the graph before each replay.
FlashInfer needs the number of query heads at plan time: the model runner's graphs set
``num_q_heads``; otherwise an eager step prepares at its first ``forward`` (still once per step).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata, KVStoreTarget
from kvfit.attention.fi_pages import page_lists
from kvfit.attention.flashinfer_mla import SLAB_DIM, FlashInferMLA

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    name = "fi"
    devices = frozenset({"cuda"})
    pools = frozenset({"MHAKVCache", "MLAKVCache"})
    kv_dtypes = frozenset({"bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"})
    kv_dtype_refusals = {"int8": "FlashInfer reads only 16-bit and fp8 KV; int8 KV (one scale "
                                 "per token and head) runs on --attention-backend triton",
                         "int4": "FlashInfer reads only 16-bit and fp8 KV; int4 KV (packed "
                                 "4-bit pages and a residual page per request) runs on "
                                 "--attention-backend triton"}
    page_sizes = None
    head_dims = frozenset({64, 128, 256})
    supports_cuda_graph = True
    # FlashInfer's MLA kernels read 16-bit and e4m3 latents (FA3's fp8 path takes e4m3 only)
    _MLA_KV_DTYPES = frozenset({"bfloat16", "float16", "fp8_e4m3"})

    @classmethod
    def head_dims_for(cls, pool_name: str):
        """MLA pools: DeepSeek's 512 + 64 latent slabs, the only shape FlashInfer's MLA reads."""
        return frozenset({SLAB_DIM}) if pool_name == "MLAKVCache" else cls.head_dims

    @classmethod
    def kv_dtypes_for(cls, pool_name: str) -> frozenset[str]:
        return cls._MLA_KV_DTYPES if pool_name == "MLAKVCache" else cls.kv_dtypes

    @classmethod
    def kv_dtype_refusals_for(cls, pool_name: str) -> dict[str, str]:
        if pool_name != "MLAKVCache":
            return cls.kv_dtype_refusals
        return {**cls.kv_dtype_refusals,
                "fp8_e5m2": "FlashInfer's MLA kernels read 16-bit and fp8_e4m3 latents; "
                            "fp8_e5m2 latents run on --attention-backend triton"}

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        super().__init__(pool, compute_dtype, sm_scale, logit_softcap)
        if pool.v_layout != "HND":
            raise ValueError(f"FlashInfer reads HND V pages; this pool stores {pool.v_layout}")
        import flashinfer

        self._fi = flashinfer
        self._ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._decode = {}  # use_tensor_cores -> eager decode wrapper
        self._graph_wrappers: dict[int, object] = {}
        self._graph_max_pages = 0
        self._active = None
        self._pending: Optional[AttentionMetadata] = None
        self._in_graph = False
        # MLA pools (latent slabs): FlashInfer's MLA wrapper owns prepare/forward_mla/graphs,
        # and no MHA wrapper is made
        self._mla = (FlashInferMLA(pool, compute_dtype, sm_scale, logit_softcap, self._ws)
                     if "mla" in pool.layer_kinds else None)
        self._prefill = (None if self._mla is not None else
                         flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws, "HND",
                                                                        backend="fa2"))

    @classmethod
    def is_available(cls) -> Optional[str]:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # ImportError, or a broken install raising at import
            return f"FlashInfer is not installed ({type(e).__name__}: {e}); pip install kvfit[fi]"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # -- preparing ----------------------------------------------------------------------------
    def _use_tc(self) -> bool:
        return self.num_q_heads // self.pool.layers[0].num_kv_heads >= 4

    def _prepare_now(self, meta: AttentionMetadata, wrapper=None) -> None:
        spec = self.pool.layers[0]
        hkv, d, ps = spec.num_kv_heads, spec.head_dim, self.pool.page_size
        indptr, indices, last, _, qo = page_lists(meta, ps)
        common = dict(q_data_type=self.compute_dtype, kv_data_type=self.pool.dtype,
                      sm_scale=self.sm_scale, logits_soft_cap=self.logit_softcap)
        if meta.is_decode:
            if wrapper is None:
                tc = self._use_tc()
                if tc not in self._decode:
                    self._decode[tc] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                        self._ws, "HND", use_tensor_cores=tc)
                wrapper = self._decode[tc]
            wrapper.plan(indptr, indices, last, self.num_q_heads, hkv, d, ps, **common)
        else:
            wrapper = self._prefill
            wrapper.plan(qo, indptr, indices, last, self.num_q_heads, hkv, d, ps,
                         causal=True, **common)
        self._active = wrapper

    def prepare(self, meta: AttentionMetadata) -> None:
        """Mutates self: plans the step's FlashInfer wrapper (deferred to the first forward
        until the query head count is known)."""
        self.meta = meta
        self._in_graph = False
        if self._mla is not None:
            if self.num_q_heads is not None:
                self._mla.num_heads = self.num_q_heads
            self._mla.prepare(meta)
            return
        if self.num_q_heads is None:
            self._pending = meta
            return
        self._pending = None
        self._prepare_now(meta)

    # -- per layer ----------------------------------------------------------------------------
    def kv_store_target(self, layer_id: int) -> Optional[KVStoreTarget]:
        """Every step stores by slot (HND pages): the caller may fuse it into its RoPE. MLA
        pools store their slabs in ``forward_mla``."""
        if self._mla is not None:
            return None
        pool = self.pool
        return KVStoreTarget(pool.k_caches[layer_id], pool.v_caches[layer_id],
                             self.meta.slot_mapping, pool.fmt, pool.k_scales[layer_id],
                             pool.v_scales[layer_id], "HND")

    def forward_mla(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int,
                    v_dim: int) -> torch.Tensor:
        """MLA pools: store the slabs and attend (attention/flashinfer_mla.py). Mutates the
        pool."""
        if self._mla is None:
            raise RuntimeError(f"forward_mla needs a pool of MLA layers (MLAKVCache), got the "
                               f"{self.pool.name} pool")
        return self._mla.forward_mla(q, kv, layer_id, v_dim, self.meta.slot_mapping)

    def forward(self, q, k, v, layer_id, kv_stored: bool = False):
        from kvfit.kernels.store import store_kv

        pool = self.pool
        kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
        ks, vs = pool.k_scales[layer_id], pool.v_scales[layer_id]
        if not kv_stored:  # else the caller stored k/v at kv_store_target(layer_id)
            store_kv(k, v, kc, vc, self.meta.slot_mapping, pool.fmt, ks, vs)
        if self._pending is not None:
            self.num_q_heads = q.shape[1]
            self._prepare_now(self._pending)
            self._pending = None
        scales = {}
        if ks != 1.0:
            scales["k_scale"] = ks
        if vs != 1.0:
            scales["v_scale"] = vs
        return self._active.run(q.contiguous(), (kc, vc), **scales)

    # -- CUDA graphs --------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        """Only records the sizes: graph wrappers are made per batch size on first plan."""
        if self.num_q_heads is None:
            raise RuntimeError("set backend.num_q_heads before init_cuda_graph (FlashInfer plans "
                               "with the query head count)")
        self._graph_max_pages = max_pages_per_req
        if self._mla is not None:
            self._mla.num_heads = self.num_q_heads
            self._mla.init_cuda_graph(max_bs, max_pages_per_req)

    def _graph_wrapper(self, bs: int):
        w = self._graph_wrappers.get(bs)
        if w is None:
            dev = self.pool.device
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._ws, "HND", use_cuda_graph=True, use_tensor_cores=self._use_tc(),
                paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(bs * self._graph_max_pages,
                                                    dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device=dev))
            self._graph_wrappers[bs] = w
        return w

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """Plan the batch size's graph wrapper (outside the graph, before capture or replay)."""
        if not meta.is_decode:
            raise ValueError("CUDA graphs are captured for decode steps only")
        self.meta = meta
        self._pending = None
        if self._mla is not None:
            self._mla.prepare_cuda_graph(meta)
            return
        self._prepare_now(meta, self._graph_wrapper(meta.batch_size))
