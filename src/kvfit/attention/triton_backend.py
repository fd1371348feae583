"""The ``triton`` attention backend: our own kernels (kvfit.kernels) over the MHAKVCache pool.

Per step ``prepare`` picks the decode launch configuration (split count from batch size and the
longest context) or, for steps with prefill chunks, the list of prefill programs. Per layer
``forward`` stores k/v with the fused quantizing store kernel (prefill steps into token-minor V
pages: by page-row chunks, ``store_kv_chunks``), then runs paged decode (every
request has one new token) or paged prefill/extend (anything else, decode tokens of a mixed
batch included as q_len 1 requests). CUDA graphs: ``init_cuda_graph`` allocates the split-K
scratch once for the largest batch, ``prepare_cuda_graph`` fixes the split count per batch size
from the largest context a request can have, so a captured grid never changes.

fp8 pools are asked for token-minor V pages (``v_layout`` "HDN", docs/kernels.md): the kernels
read either layout, whichever the pool has.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata, KVStoreTarget
from kvfit.kernels.decode import choose_config, paged_decode
from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
from kvfit.kernels.store import split_store_chunks, store_kv, store_kv_chunks


class TritonBackend(AttentionBackend):
    name = "triton"
    devices = frozenset({"cuda"})
    pools = frozenset({"MHAKVCache"})
    kv_dtypes = frozenset({"float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"})
    # int8 (and its kv_transforms) is declared by the int8 kernels' branch (issue 14, kvkern)
    kv_dtype_refusals = {"int8": "the int8 Triton kernels are not in this build yet; use "
                                 "--attention-backend torch (reference) or fp8_e4m3"}
    page_sizes = None  # any (powers of two are fastest)
    head_dims = frozenset({64, 128, 256})
    supports_cuda_graph = True

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        super().__init__(pool, compute_dtype, sm_scale, logit_softcap)
        self._decode_cfg = None
        self._blocks = None
        self._prefill_cfg = None
        self._store_chunks: Optional[torch.Tensor] = None
        self._graph_max_len: Optional[int] = None
        self._scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._v_t = pool.v_layout == "HDN"

    @classmethod
    def v_layout(cls, kv_dtype: str, page_size: int, head_dim: int) -> str:
        """Token-minor V for fp8 with heads of >= 128 (no 8-bit transpose in the P@V operand:
        2.9-3.06 TB/s against 2.2-2.3 for HND on the H200); HND for 16/32-bit pools and 64-d fp8
        heads, where the HND tile measured as fast or faster (docs/kernels.md)."""
        pow2 = page_size > 0 and page_size & (page_size - 1) == 0
        return "HDN" if kv_dtype.startswith("fp8") and pow2 and head_dim >= 128 else "HND"

    @classmethod
    def default_page_size(cls, kv_dtype: str, head_dim: int) -> int:
        """32 for fp8 with heads of >= 128: a token-minor V row of a page is then a whole 32-byte
        L2 sector (3.7-4.07 TB/s decode on the H200 against 2.9-3.0 at pages of 16)."""
        return 32 if kv_dtype.startswith("fp8") and head_dim >= 128 else 16

    @classmethod
    def is_available(cls) -> Optional[str]:
        try:
            import triton  # noqa: F401  (availability check)
        except ImportError:
            return "Triton is not installed"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # -- preparing (host side, once per step) -------------------------------------------
    def _layer_shape(self) -> tuple[int, int]:
        spec = self.pool.layers[0]
        return spec.num_kv_heads, spec.head_dim

    def _prepare_decode(self, meta: AttentionMetadata, max_len: int) -> None:
        hkv, d = self._layer_shape()
        # the group is fixed by the model; q heads are only known at forward, so prepare on Hkv
        self._decode_cfg = choose_config(meta.batch_size, hkv, 1, d, max_len, self.pool.dtype,
                                         self.compute_dtype, v_t=self._v_t)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Mutates self: the step's metadata and launch plan. Host work only (no syncs)."""
        self.meta = meta
        if meta.is_decode:
            self._prepare_decode(meta, max(meta.kv_lens_cpu, default=1))
            self._blocks = None
        else:
            _, d = self._layer_shape()
            self._prefill_cfg = prefill_config(d, self.compute_dtype, self.pool.dtype)
            self._q_lens = list(meta.q_lens_cpu)
            self._kv_lens = list(meta.kv_lens_cpu)
            self._blocks = {}
            if self._v_t:  # token-minor V: store a page row's new tokens together
                real = len(self._q_lens) if meta.num_real_reqs is None else meta.num_real_reqs
                self._store_chunks = split_store_chunks(
                    self._q_lens[:real], self._kv_lens[:real], self.pool.page_size,
                    meta.cu_seqlens_q.device)

    def _prefill_blocks(self, group: int) -> torch.Tensor:
        if group not in self._blocks:
            self._blocks[group] = order_prefill_blocks(
                self._q_lens, group, self._prefill_cfg.block_m, self.meta.cu_seqlens_q.device,
                self._kv_lens)
        return self._blocks[group]

    # -- per layer ------------------------------------------------------------------------
    def kv_store_target(self, layer_id: int) -> Optional[KVStoreTarget]:
        """The slot-mapped store (decode steps, and prefill into HND pages) may be fused into
        the caller's RoPE kernel; prefill into token-minor V pages stores by page-row chunks."""
        if self._v_t and not self.meta.is_decode:
            return None
        pool = self.pool
        return KVStoreTarget(pool.k_caches[layer_id], pool.v_caches[layer_id],
                             self.meta.slot_mapping, pool.fmt, pool.k_scales[layer_id],
                             pool.v_scales[layer_id], pool.v_layout)

    def forward(self, q, k, v, layer_id, kv_stored: bool = False):
        meta = self.meta
        pool = self.pool
        kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
        ks, vs = pool.k_scales[layer_id], pool.v_scales[layer_id]
        if kv_stored:
            pass  # the caller stored k/v at kv_store_target(layer_id)
        elif self._v_t and not meta.is_decode:
            store_kv_chunks(k, v, kc, vc, self._store_chunks, meta.cu_seqlens_q, meta.kv_lens,
                            meta.block_table, pool.fmt, ks, vs)
        else:
            store_kv(k, v, kc, vc, meta.slot_mapping, pool.fmt, ks, vs, pool.v_layout)
        spec = pool.layers[layer_id]
        window = spec.window if spec.kind == "sliding" else None
        out = torch.empty_like(q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if meta.is_decode:
            cfg = self._decode_cfg
            scratch = None  # static split-K scratch when it is large enough, else allocated
            n = q.shape[0] * q.shape[1] * cfg.num_splits
            if self._scratch is not None and cfg.num_splits > 1 and n <= self._scratch[1].shape[0]:
                scratch = (self._scratch[0][:n], self._scratch[1][:n])
            paged_decode(q, kc, vc, meta.block_table, meta.kv_lens, out, self.sm_scale, cfg,
                         ks, vs, self.logit_softcap, window, scratch)
        else:
            group = q.shape[1] // kc.shape[1]
            paged_prefill(q, kc, vc, meta.block_table, meta.cu_seqlens_q, meta.kv_lens,
                          self._prefill_blocks(group), self._prefill_cfg, out, self.sm_scale,
                          ks, vs, self.logit_softcap, window, v_t=self._v_t)
        return out

    # -- CUDA graphs ------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        """Allocate split-K scratch for ``max_bs`` decode rows at the most splits any batch size
        gets with contexts up to ``max_pages_per_req`` pages (static across replays)."""
        hkv, d = self._layer_shape()
        self._graph_max_len = max_pages_per_req * self.pool.page_size
        most = 1
        for bs in range(1, max_bs + 1):
            cfg = choose_config(bs, hkv, 1, d, self._graph_max_len, self.pool.dtype,
                                self.compute_dtype, v_t=self._v_t)
            most = max(most, bs * cfg.num_splits)
        hq_max = 16 * hkv  # up to 16 query heads per KV head (larger: allocated per call)
        dev = self.pool.device
        self._scratch = (torch.empty((most * hq_max, d), dtype=torch.float32, device=dev),
                         torch.empty((most * hq_max,), dtype=torch.float32, device=dev))

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """Same as ``prepare`` for a decode batch, but with the split count fixed by batch size."""
        if self._graph_max_len is None:
            raise RuntimeError("init_cuda_graph must be called before prepare_cuda_graph")
        self.meta = meta
        self._blocks = None
        self._prepare_decode(meta, self._graph_max_len)
