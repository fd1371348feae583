"""The attention backend interface and the per-step metadata every backend translates.

A step's batch is a flat list of tokens from B requests (prefill chunks and decode tokens mixed).
``AttentionMetadata`` describes it once (``meta_builder.build_step_metadata``); each backend's
``prepare(meta)`` turns it into whatever its kernels need (once per step) and
``forward(q, k, v, layer_id)`` is called per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvfit.kvcache.int4_residual import ResidualPlan


@dataclass
class SlidingTables:
    """The sliding layers' view of a step in a pool whose sliding layers have their own page
    space (``pool.sliding_pages``): same shapes as the plain fields of AttentionMetadata.

    block_table [B, max_pages] int32 (logical pages; freed ones = the null page),
    slot_mapping [T] int64 (slots in the sliding page space), num_pages_cpu (logical pages),
    first_live_cpu (first logical page each request's queries can see).
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_pages_cpu: list[int]
    first_live_cpu: list[int]


@dataclass
class AttentionMetadata:
    """One step's batch layout. Device tensors live on the model's device; ``*_cpu`` lists are
    host copies for backends that prepare on the host (no device->host syncs needed).

    cu_seqlens_q: [B+1] int32, query token offsets of each request in the flat batch.
    kv_lens:      [B] int32, tokens in the cache for each request *after* this step's store.
    block_table:  [B, max_pages] int32, the request's page ids (padded with 0).
    slot_mapping: [T] int64, flat slot (page * page_size + offset) for each new token, -1 = pad.
    swa:          the sliding layers' tables when the pool keeps them in a page space of their
                  own (``pool.sliding_pages`` set), else None.
    residual:     the int4 pool's store plan and each request's residual slot
                  (``kvcache.int4_residual.ResidualPlan``) when the pool has ``residual_slots``.
    """

    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens_cpu: list[int]
    kv_lens_cpu: list[int]
    num_pages_cpu: list[int]
    is_decode: bool  # every request has exactly one query token
    # CUDA-graph padding: B may exceed the number of real requests; padded rows have kv_len 0.
    num_real_reqs: Optional[int] = None
    swa: Optional[SlidingTables] = None
    residual: Optional[ResidualPlan] = None

    @property
    def batch_size(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens_cpu)


@dataclass
class KVStoreTarget:
    """Where one layer's new K/V go in a slot-mapped store: the pool's caches of that layer,
    the step's slots, the pool's format, scales and V layout. A model may write K/V there
    itself (fused into its RoPE kernel) and then call the backend with ``kv_stored=True``.

    int8 pools add their float16 scale caches ``[pages, Hkv, P]`` (one scale per token and
    head); ``k_mean`` ``[Hkv, D]`` float32 (K centering) is subtracted from k before it is
    quantized. ``rotate``: the KV transform's Hadamard rotation, which q needs too, so only
    ``apply_rope(kv_store=...)`` can fill such a target (it returns q rotated)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    fmt: object  # KVFormat
    k_scale: float
    v_scale: float
    v_layout: str
    k_scale_cache: Optional[torch.Tensor] = None
    v_scale_cache: Optional[torch.Tensor] = None
    k_mean: Optional[torch.Tensor] = None
    rotate: bool = False

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The unfused store (``kernels.store.store_kv``): mutates the caches."""
        from kvfit.kernels.store import store_kv

        if self.rotate:
            raise ValueError("a rotating KV store target rotates q as well: fill it with "
                             "kvfit.kernels.fused_rope.apply_rope(kv_store=...), not store()")

        store_kv(k, v, self.k_cache, self.v_cache, self.slot_mapping, self.fmt, self.k_scale,
                 self.v_scale, self.v_layout, k_scale_cache=self.k_scale_cache,
                 v_scale_cache=self.v_scale_cache, k_mean=self.k_mean)


class AttentionBackend:
    """Owns the attention computation over a KV pool.

    Declares what it supports (``devices``, ``pools``, ``kv_dtypes``, ``page_sizes``, head dims,
    CUDA graphs); the engine's guard checks a whole combination against these before loading
    weights. ``forward`` stores the step's new k/v into the pool (quantize on store) and returns
    attention over all cached tokens (dequantize on read).
    """

    name: ClassVar[str] = "base"
    devices: ClassVar[frozenset[str]] = frozenset()
    pools: ClassVar[frozenset[str]] = frozenset()
    kv_dtypes: ClassVar[frozenset[str]] = frozenset()
    page_sizes: ClassVar[Optional[frozenset[int]]] = None  # None = any
    head_dims: ClassVar[Optional[frozenset[int]]] = None  # None = any
    supports_cuda_graph: ClassVar[bool] = False
    # prefill/extend steps in CUDA graphs (engine/prefill_graph.py): init_prefill_graph,
    # prepare_prefill_graph and prefill_graph_block_m
    supports_prefill_graph: ClassVar[bool] = False
    # why this backend leaves a KV dtype out of kv_dtypes, and what to use instead (the guard)
    kv_dtype_refusals: ClassVar[dict[str, str]] = {}
    # the parts of pool.kv_transform it applies (kvcache/kv_transform.py): "k_mean" (K centering,
    # q.mu added back before a soft-cap) and "rotate" (q, k Hadamard rotation after RoPE)
    kv_transforms: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        self.pool = pool
        self.compute_dtype = compute_dtype
        self.sm_scale = sm_scale
        self.logit_softcap = logit_softcap
        self.meta: Optional[AttentionMetadata] = None
        # query heads per token: set by CUDA graphs before capture (FlashInfer prepares with it),
        # else learnt at the first forward by the backends that need it
        self.num_q_heads: Optional[int] = None

    @classmethod
    def v_layout(cls, kv_dtype: str, page_size: int, head_dim: int,
                 pool_name: Optional[str] = None) -> str:
        """The V page layout this backend reads fastest for a KV dtype and head size in the pool
        ``pool_name`` (a pool constructor argument; "HND" is what every backend reads)."""
        return "HND"

    @classmethod
    def head_dims_for(cls, pool_name: str) -> Optional[frozenset[int]]:
        """The head sizes (``KVLayerSpec.head_dim``) this backend reads in the pool
        ``pool_name``; None = any. Default: ``head_dims``."""
        return cls.head_dims

    @classmethod
    def kv_dtypes_for(cls, pool_name: str) -> frozenset[str]:
        """The KV dtypes this backend reads in the pool ``pool_name``. Default: ``kv_dtypes``."""
        return cls.kv_dtypes

    @classmethod
    def kv_dtype_refusals_for(cls, pool_name: str) -> dict[str, str]:
        """Why a KV dtype is left out of ``kv_dtypes_for(pool_name)``, and what to use instead.
        Default: ``kv_dtype_refusals``."""
        return cls.kv_dtype_refusals

    @classmethod
    def default_page_size(cls, kv_dtype: str, head_dim: int) -> int:
        """Tokens per page when the user sets none (vLLM's 16 unless a backend measured better)."""
        return 16

    @classmethod
    def is_available(cls) -> Optional[str]:
        """None when usable here, else the reason (e.g. 'FlashInfer is not installed')."""
        return None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Prepare for one step (called once per step, outside CUDA graphs). Mutates self."""
        self.meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_id: int, kv_stored: bool = False) -> torch.Tensor:
        """q [T, q_heads, D], k/v [T, kv_heads, D] (compute dtype) -> out [T, q_heads, D].

        Mutates the pool: stores k and v at ``meta.slot_mapping`` first, unless ``kv_stored``
        (the caller wrote them to ``kv_store_target(layer_id)`` already).
        """
        raise NotImplementedError

    def kv_store_target(self, layer_id: int) -> Optional[KVStoreTarget]:
        """This step's slot-mapped store of ``layer_id`` when the caller may do it (fused into
        its RoPE kernel), else None (the backend stores in ``forward``). Default: None."""
        return None

    # CUDA-graph hooks: backends that support graphs allocate static buffers for a max batch.
    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")
