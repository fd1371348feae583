"""The ``fi`` attention backend: FlashInfer's paged kernels over the MHAKVCache pool (HND pages).

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

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    name = "fi"
    devices = frozenset({"cuda"})
    pools = frozenset({"MHAKVCache"})
    kv_dtypes = frozenset({"bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"})
    kv_dtype_refusals = {"int8": "FlashInfer reads only 16-bit and fp8 KV; int8 KV (one scale "
                                 "per token and head) runs on --attention-backend triton",
                         "int4": "FlashInfer reads only 16-bit and fp8 KV; int4 KV (packed "
                                 "4-bit pages and a residual page per request) runs on "
                                 "--attention-backend triton"}
    page_sizes = None
    head_dims = frozenset({64, 128, 256})
    supports_cuda_graph = True

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        super().__init__(pool, compute_dtype, sm_scale, logit_softcap)
        if pool.v_layout != "HND":
            raise ValueError(f"FlashInfer reads HND V pages; this pool stores {pool.v_layout}")
        import flashinfer

        self._fi = flashinfer
        self._ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._decode = {}  # use_tensor_cores -> eager decode wrapper
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws, "HND",
                                                                       backend="fa2")
        self._graph_wrappers: dict[int, object] = {}
        self._graph_max_pages = 0
        self._active = None
        self._pending: Optional[AttentionMetadata] = None
        self._in_graph = False

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

    def _page_lists(self, meta: AttentionMetadata):
        """(indptr cpu, indices device, last_page_len cpu) from the metadata, no device sync."""
        ps = self.pool.page_size
        n = meta.num_pages_cpu
        width = meta.block_table.shape[1]
        indptr = torch.zeros(len(n) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(n, dtype=torch.int32), 0)
        used = torch.arange(width)[None, :] < torch.tensor(n)[:, None]  # [B, width] host
        gather = used.reshape(-1).nonzero().squeeze(1).to(meta.block_table.device,
                                                          non_blocking=True)
        indices = meta.block_table.reshape(-1)[gather]
        last = torch.tensor([kv - (k - 1) * ps if k else 0 for kv, k in zip(meta.kv_lens_cpu, n)],
                            dtype=torch.int32)
        return indptr, indices, last

    def _prepare_now(self, meta: AttentionMetadata, wrapper=None) -> None:
        spec = self.pool.layers[0]
        hkv, d, ps = spec.num_kv_heads, spec.head_dim, self.pool.page_size
        indptr, indices, last = self._page_lists(meta)
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
            qo = torch.tensor([0] + list(meta.q_lens_cpu), dtype=torch.int32).cumsum(0)
            wrapper = self._prefill
            wrapper.plan(qo.to(torch.int32), indptr, indices, last, self.num_q_heads, hkv, d, ps,
                         causal=True, **common)
        self._active = wrapper

    def prepare(self, meta: AttentionMetadata) -> None:
        """Mutates self: plans the step's FlashInfer wrapper (deferred to the first forward
        until the query head count is known)."""
        self.meta = meta
        self._in_graph = False
        if self.num_q_heads is None:
            self._pending = meta
            return
        self._pending = None
        self._prepare_now(meta)

    # -- per layer ----------------------------------------------------------------------------
    def kv_store_target(self, layer_id: int) -> Optional[KVStoreTarget]:
        """Every step stores by slot (HND pages): the caller may fuse it into its RoPE."""
        pool = self.pool
        return KVStoreTarget(pool.k_caches[layer_id], pool.v_caches[layer_id],
                             self.meta.slot_mapping, pool.fmt, pool.k_scales[layer_id],
                             pool.v_scales[layer_id], "HND")

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
        self._prepare_now(meta, self._graph_wrapper(meta.batch_size))
