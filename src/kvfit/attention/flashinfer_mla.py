"""The fi backend's MLA half: FlashInfer's MLA kernels over the ``MLAKVCache`` latent pool.

FlashInfer's ``BatchMLAPagedAttentionWrapper`` runs the weight-absorbed MLA (its FA3 kernel on
Hopper, FA2 on other GPUs) on exactly our pool's layout: one ``[num_pages, page_size, 576]``
slab per layer (latent ``c`` of 512 then the rope key of 64; "packed" in FlashInfer's words) and
packed queries ``[T, H, 576]``. Measured on the H200 (docs/benchmarks.md, "MLA through
FlashInfer"): at bf16 its decode kernel is 1.2-1.5x faster than our Triton one (66-96% of the
copy bandwidth against 54-64%), at fp8_e4m3 slower (12-16% against 17-23%). End to end (8
V2-Lite layers, bf16, 16k contexts) fi decodes 11-14% faster at batch 64, 2% slower at batch 8
and 7-13% slower at batch 1, so ``auto`` keeps triton and fi is chosen by name
(``--attention-backend fi``) for batched long-context 16-bit serving.

Interface (as attention/torch_mla.py): ``forward_mla(q [T, H, 576], kv [T, 576], layer_id,
v_dim=512) -> [T, H, 512]``: stores the step's slabs with our quantizing store (one launch),
then attends: decode steps plain, other steps (prefill, extend, mixed) causal with each
request's last query on its last key.

Per step ``prepare`` plans one wrapper (host page lists plus one device gather of the block
table, no host sync); the plan needs the query head count, so an eager step plans at its first
``forward_mla`` unless ``num_heads`` is known. CUDA graphs: one wrapper per captured batch size
with static metadata buffers, re-planned outside the graph before each replay.
Owns its wrappers; mutates the pool's latent caches in ``forward_mla``.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.attention.fi_pages import page_lists
from kvfit.kernels.mla import store_latent

CKV_DIM = 512  # FlashInfer's MLA kernels: DeepSeek's latent width ...
KPE_DIM = 64  # ... and rope-key width
SLAB_DIM = CKV_DIM + KPE_DIM


class FlashInferMLA:
    """Plans and runs FlashInfer's MLA wrapper for the ``fi`` backend over an MLAKVCache."""

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float], workspace: torch.Tensor):
        if logit_softcap is not None:
            raise ValueError("FlashInfer's MLA kernels have no logit soft-capping; use "
                             "--attention-backend torch for such a model")
        if compute_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer's MLA kernels take 16-bit queries, not {compute_dtype}; "
                             "use --attention-backend triton (or torch) for float32 compute")
        slab = pool.layers[0].head_dim
        if slab != SLAB_DIM:
            raise ValueError(f"FlashInfer's MLA kernels read slabs of {CKV_DIM} + {KPE_DIM} "
                             f"(DeepSeek-V2/V3), this model's are {slab} wide; use "
                             "--attention-backend triton")
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self._wrapper_cls, self._meta_cls = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        major, _ = torch.cuda.get_device_capability(pool.device)
        self.kernel = "fa3" if major == 9 else "fa2"  # FlashInfer's Hopper MLA, else FA2's
        self.pool = pool
        self.compute_dtype = compute_dtype
        self.sm_scale = sm_scale
        self.num_heads: Optional[int] = None
        self._ws = workspace
        self._eager = BatchMLAPagedAttentionWrapper(workspace, backend=self.kernel)
        self._graph_wrappers: dict[int, object] = {}
        self._graph_max_pages = 0
        self._active = None
        self._pending: Optional[tuple[AttentionMetadata, object]] = None

    def _plan(self, meta: AttentionMetadata, wrapper) -> None:
        pl = page_lists(meta, self.pool.page_size)
        wrapper.plan(metadata=self._meta_cls.csr(pl.qo_indptr, pl.indptr, pl.indices, pl.kv_len),
                     num_heads=self.num_heads, head_dim_ckv=CKV_DIM, head_dim_kpe=KPE_DIM,
                     page_size=self.pool.page_size, causal=not meta.is_decode,
                     sm_scale=self.sm_scale, q_data_type=self.compute_dtype,
                     kv_data_type=self.pool.dtype)
        self._active = wrapper

    def prepare(self, meta: AttentionMetadata, wrapper=None) -> None:
        """Plan the step (at the first ``forward_mla`` while the head count is unknown)."""
        wrapper = self._eager if wrapper is None else wrapper
        if self.num_heads is None:
            self._pending = (meta, wrapper)
            return
        self._pending = None
        self._plan(meta, wrapper)

    def forward_mla(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, v_dim: int,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
        """Store ``kv`` at ``slot_mapping`` and attend (module docstring). Mutates the pool."""
        if v_dim != CKV_DIM or q.shape[-1] != SLAB_DIM:
            raise ValueError(f"FlashInfer's MLA kernels attend with {CKV_DIM}-wide values over "
                             f"{SLAB_DIM}-wide slabs, got {v_dim} over {q.shape[-1]}")
        pool = self.pool
        cache, scale = pool.kv_caches[layer_id], pool.k_scales[layer_id]
        store_latent(kv, cache, slot_mapping, pool.fmt, scale)
        if self._pending is not None:
            self.num_heads = q.shape[1]
            self._plan(*self._pending)
            self._pending = None
        scales = {}
        if pool.dtype not in (torch.bfloat16, torch.float16):  # per-tensor fp8 latents
            scales = dict(ckv_scale=float(scale), kpe_scale=float(scale))
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        self._active.run(query=q.contiguous(), kv_cache=cache, out=out, **scales)
        return out

    # -- CUDA graphs (decode steps) -----------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        """Records the sizes; graph wrappers are made per batch size at their first plan."""
        if self.num_heads is None:
            raise RuntimeError("set backend.num_q_heads before init_cuda_graph (FlashInfer plans "
                               "with the query head count)")
        self._graph_max_pages = max_pages_per_req

    def graph_wrapper(self, bs: int):
        """The batch size's wrapper with static metadata buffers (made once)."""
        w = self._graph_wrappers.get(bs)
        if w is None:
            dev = self.pool.device

            def buf(n):
                return torch.zeros(n, dtype=torch.int32, device=dev)

            w = self._wrapper_cls(self._ws, use_cuda_graph=True, qo_indptr=buf(bs + 1),
                                  kv_indptr=buf(bs + 1),
                                  kv_indices=buf(bs * self._graph_max_pages),
                                  kv_len_arr=buf(bs), backend=self.kernel)
            self._graph_wrappers[bs] = w
        return w

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """Plan the batch size's graph wrapper (outside the graph, before capture or replay)."""
        if not meta.is_decode:
            raise ValueError("CUDA graphs are captured for decode steps only")
        self.prepare(meta, self.graph_wrapper(meta.batch_size))
