"""The ``triton`` attention backend: our own kernels (kvfit.kernels) over the MHAKVCache pool,
the hybrid sliding-window pool (HybridSWAKVCache, Gemma 2/3), the MLAKVCache latent pool
through ``attention/triton_mla.py`` (``forward_mla``), and the int4 pool (Int4KVCache,
``--kv-dtype int4``) through ``attention/triton_int4.py``.

Per step ``prepare`` picks the decode launch configuration (split count from batch size and the
longest context) or, for steps with prefill chunks, the list of prefill programs. Per layer
``forward`` stores k/v with the fused quantizing store kernel (prefill steps into token-minor V
pages: by page-row chunks, ``store_kv_chunks``), then runs paged decode (every
request has one new token) or paged prefill/extend (anything else, decode tokens of a mixed
batch included as q_len 1 requests). CUDA graphs: ``init_cuda_graph`` allocates the split-K
scratch once for the largest batch, ``prepare_cuda_graph`` fixes the split count per batch size
from the largest context a request can have, so a captured grid never changes.

8-bit pools (fp8, int8) with heads of >= 128 are asked for token-minor V pages (``v_layout``
"HDN", docs/kernels.md): the kernels read either layout, whichever the pool has.

int8 pools keep one float16 scale per (token, KV head) in ``pool.k_scale_caches[layer]`` /
``pool.v_scale_caches[layer]`` ``[pages, Hkv, P]``; the stores write them, the attention kernels
fold them into the logits and P. The pool's ``kv_transform`` (K centering ``k_mean[layer]``
``[Hkv, D]`` float32, and for int8 an orthonormal Hadamard rotation of q and k per head) is
applied here: the mean is subtracted inside the store kernels (no extra launch; also inside the
fused RoPE + store), the rotation by ``kv_transform.transform_qk`` before an unfused store.

Sliding-window layers: the kernels take the window (decode splits only the last ``window``
tokens; prefill starts each block's tiles at its first row's window edge). In a windowed hybrid
pool (``pool.sliding_pages`` set) a sliding layer stores and reads through ``meta.swa``: its
block table is indexed by logical page like the full layers' one, pages that fell out of the
window are the pool's zero-filled null page, which no kernel reads outside its window mask (an
int8 pool's sliding scale pages live in the same page space, the null page's scales zero). The
sliding layers get their own decode plan (split count from the window, not the context).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata, KVStoreTarget
from kvfit.attention.triton_int4 import TritonInt4
from kvfit.attention.triton_mla import TritonMLA
from kvfit.kernels import decode_8bit_gluon, decode_int4
from kvfit.kernels.decode import DecodeConfig, choose_config, paged_decode
from kvfit.kernels.prefill import order_prefill_blocks, paged_prefill, prefill_config
from kvfit.kernels.prefill_split import SPLIT_MAX_TOKENS, ExtendSplit, wants_split
from kvfit.kernels.store import split_store_chunks, store_kv, store_kv_chunks


class TritonBackend(AttentionBackend):
    name = "triton"
    devices = frozenset({"cuda"})
    pools = frozenset({"MHAKVCache", "HybridSWAKVCache", "MLAKVCache", "Int4KVCache"})
    kv_dtypes = frozenset({"float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8",
                           "int4"})
    # K centering (subtracted in the store kernels; q . mu added back before a soft-cap) and
    # the rotation (fused into the RoPE + store kernel, or transform_qk before the store)
    kv_transforms = frozenset({"k_mean", "rotate"})
    page_sizes = None  # any (powers of two are fastest)
    head_dims = frozenset({64, 128, 256})
    supports_cuda_graph = True

    def __init__(self, pool, compute_dtype: torch.dtype, sm_scale: float,
                 logit_softcap: Optional[float] = None):
        super().__init__(pool, compute_dtype, sm_scale, logit_softcap)
        self._decode_cfg: Optional[DecodeConfig] = None
        self._decode_cfg_swa: Optional[DecodeConfig] = None  # sliding layers: split the window
        windows = [l.window for l in pool.layers if l.kind == "sliding" and l.window]
        self._window = max(windows) if windows else None
        self._blocks = None
        self._prefill_cfg = None
        self._store_chunks: Optional[torch.Tensor] = None
        self.extend_split = ExtendSplit()  # split-KV scratch of short prefill/extend steps
        self._split_step = False  # this step's full layers split their keys
        self._graph_max_len: Optional[int] = None
        self._scratch: Optional[tuple[torch.Tensor, ...]] = None  # op, lse, merge counts
        self._v_t = pool.v_layout == "HDN"
        self._gluon8: Optional[bool] = None  # _gluon_decode's answer, decided once
        self._k_means: dict[int, Optional[torch.Tensor]] = {}
        # MLA pools (latent slabs): the MLA kernels own prepare/forward_mla/graph hooks
        self._mla = (TritonMLA(pool, compute_dtype, sm_scale, logit_softcap)
                     if "mla" in pool.layer_kinds else None)
        # the int4 pool (packed pages + residual slots): attention/triton_int4.py
        self._int4 = (TritonInt4(pool, compute_dtype, sm_scale, logit_softcap)
                      if pool.name == "Int4KVCache" else None)

    @classmethod
    def head_dims_for(cls, pool_name: str):
        """MLA slabs of any width (the kernels pad rank and rope to powers of two)."""
        return None if pool_name == "MLAKVCache" else cls.head_dims

    @classmethod
    def v_layout(cls, kv_dtype: str, page_size: int, head_dim: int,
                 pool_name: Optional[str] = None) -> str:
        """Token-minor V for 8-bit pools with heads of >= 64 (no 8-bit transpose in the P@V
        operand: 2.9-3.06 TB/s against 2.2-2.3 for HND on the H200 with fp8 128-d heads; 64-d
        heads read several KV heads per program over it, 3.34-3.43 TB/s against 2.68 for the
        HND tile); HND for 16/32-bit pools and smaller heads (docs/kernels.md)."""
        if pool_name == "MLAKVCache":  # one latent slab per token: no separate V pages
            return "HND"
        if pool_name == "Int4KVCache":  # token-minor where the register int4 decode is default
            return "HDN" if decode_int4.regs_default_here(head_dim) else "HND"
        pow2 = page_size > 0 and page_size & (page_size - 1) == 0
        return "HDN" if _eight_bit(kv_dtype) and pow2 and head_dim >= 64 else "HND"

    @classmethod
    def default_page_size(cls, kv_dtype: str, head_dim: int) -> int:
        """32 for 8-bit pools with heads of >= 128: a token-minor V row of a page is then a whole
        32-byte L2 sector (3.7-4.07 TB/s fp8 decode on the H200 against 2.9-3.0 at pages of
        16)."""
        return 32 if _eight_bit(kv_dtype) and head_dim >= 128 else 16

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

    def _gluon_decode(self) -> bool:
        """Full-attention decode runs the Gluon 8-bit kernel (kernels/decode_8bit_gluon.py)
        by default for this pool: a Hopper GPU whose ``DEFAULT_ON`` entry lists its (format,
        head size), and the kernel fits (16-bit queries, token-minor V, no soft-cap)."""
        if self._gluon8 is None:
            _, d = self._layer_shape()
            pool = self.pool
            self._gluon8 = decode_8bit_gluon.engine_default(
                pool.dtype, self.compute_dtype, d, pool.page_size, self._v_t, pool.device,
                self.logit_softcap)
        return self._gluon8

    def _decode_config(self, batch: int, max_len: int, sliding: bool = False) -> DecodeConfig:
        hkv, d = self._layer_shape()
        # the group is fixed by the model; q heads are only known at forward, so prepare on Hkv
        group = 1 if self.num_q_heads is None else self.num_q_heads // hkv
        return choose_config(batch, hkv, group, d, max_len, self.pool.dtype, self.compute_dtype,
                             v_t=self._v_t, page_size=self.pool.page_size,
                             gluon=not sliding and self._gluon_decode())

    def _prepare_decode(self, meta: AttentionMetadata, max_len: int) -> None:
        self._decode_cfg = self._decode_config(meta.batch_size, max_len)
        if self._window is not None:  # a sliding layer reads at most the window
            self._decode_cfg_swa = self._decode_config(meta.batch_size,
                                                       min(max_len, self._window), True)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Mutates self: the step's metadata and launch plan. Host work only (no syncs)."""
        self.meta = meta
        if self._mla is not None:
            self._mla.prepare(meta)
            return
        if self._int4 is not None:
            self._int4.prepare(meta)
            return
        if meta.is_decode:
            self._prepare_decode(meta, max(meta.kv_lens_cpu, default=1))
            self._blocks = None
        else:
            _, d = self._layer_shape()
            self._prefill_cfg = prefill_config(d, self.compute_dtype, self.pool.dtype)
            self._q_lens = list(meta.q_lens_cpu)
            self._kv_lens = list(meta.kv_lens_cpu)
            self._blocks = {}
            self._split_step = wants_split(meta.num_tokens, max(self._kv_lens, default=0),
                                           self._prefill_cfg.block_n, self.extend_split.min_tiles)
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
    def _tables(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        """(block table, slot mapping, window) of a layer this step: a sliding layer of a
        windowed hybrid pool reads its own page space (``meta.swa``)."""
        meta = self.meta
        spec = self.pool.layers[layer_id]
        if spec.kind != "sliding":
            return meta.block_table, meta.slot_mapping, None
        if self.pool.sliding_pages is None:  # shared page ids: the window is a mask only
            return meta.block_table, meta.slot_mapping, spec.window
        if meta.swa is None:
            raise RuntimeError(f"the {self.pool.name} pool keeps sliding layers in their own page "
                               "space: build the step's metadata with kvfit.attention."
                               "meta_builder.build_step_metadata (or build_hybrid_metadata)")
        return meta.swa.block_table, meta.swa.slot_mapping, spec.window

    # -- the KV transform and the int8 scale caches ---------------------------------------
    def _rotates(self) -> bool:
        tr = getattr(self.pool, "kv_transform", None)
        return bool(tr is not None and getattr(tr, "rotate", False))

    def _k_mean(self, layer_id: int) -> Optional[torch.Tensor]:
        """The layer's K mean ``[Hkv, D]`` float32 on the pool's device (copied once if the
        transform keeps it elsewhere), or None when K centering is off."""
        if layer_id not in self._k_means:
            tr = getattr(self.pool, "kv_transform", None)
            means = None if tr is None else getattr(tr, "k_mean", None)
            mu = None if means is None else means[layer_id]
            if mu is not None:
                mu = mu.to(device=self.pool.device, dtype=torch.float32).contiguous()
            self._k_means[layer_id] = mu
        return self._k_means[layer_id]

    def _q_bias(self, layer_id: int, q: torch.Tensor,
                q_rotated: bool) -> Optional[torch.Tensor]:
        """q . k_mean per token and query head ``[T, Hq]`` float32, which a centered K cache
        takes off every logit of a row: softmax ignores it, a soft-cap does not, so layers with
        one get it added back (``q_rotated``: q was rotated by the transform, and then so is
        the mean, q' . mu' = q . mu)."""
        mu = self._k_mean(layer_id)
        if self.logit_softcap is None or mu is None:
            return None
        if q_rotated:
            from kvfit.kernels.hadamard import fwht

            mu = fwht(mu)
        t, hq, d = q.shape
        hkv = mu.shape[0]
        qg = q.float().view(t, hkv, hq // hkv, d)  # [T, Hq, D] -> [T, Hkv, G, D]
        return (qg * mu[None, :, None, :]).sum(-1).view(t, hq)

    def _scale_caches(self, layer_id: int):
        """(k, v) float16 scale caches ``[pages, Hkv, P]`` of an int8 pool's layer, else
        (None, None)."""
        if self.pool.dtype != torch.int8:
            return None, None
        return self.pool.k_scale_caches[layer_id], self.pool.v_scale_caches[layer_id]

    def kv_store_target(self, layer_id: int) -> Optional[KVStoreTarget]:
        """The slot-mapped store (decode steps, and prefill into HND pages) may be fused into
        the caller's RoPE kernel, K centering and the rotation included (the RoPE kernel then
        returns q rotated); prefill into token-minor V pages stores by page-row chunks."""
        if (self._mla is not None or self._int4 is not None
                or (self._v_t and not self.meta.is_decode)):
            return None
        pool = self.pool
        _, slots, _ = self._tables(layer_id)
        ksc, vsc = self._scale_caches(layer_id)
        return KVStoreTarget(pool.k_caches[layer_id], pool.v_caches[layer_id], slots, pool.fmt,
                             pool.k_scales[layer_id], pool.v_scales[layer_id], pool.v_layout,
                             k_scale_cache=ksc, v_scale_cache=vsc, k_mean=self._k_mean(layer_id),
                             rotate=self._rotates())

    def forward_mla(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int,
                    v_dim: int) -> torch.Tensor:
        """MLA pools: store the slabs and attend (attention/triton_mla.py). Mutates the pool."""
        if self._mla is None:
            raise RuntimeError(f"forward_mla needs a pool of MLA layers (MLAKVCache), got the "
                               f"{self.pool.name} pool")
        return self._mla.forward_mla(q, kv, layer_id, v_dim)

    def forward(self, q, k, v, layer_id, kv_stored: bool = False):
        """Stores k/v (quantize, K centering) unless ``kv_stored``, then attends. With a
        rotating transform q and k are rotated too, unless ``kv_stored`` (the fused RoPE store
        rotated q already): in a prefill step into token-minor V pages inside the page-chunk
        store (k) and the prefill kernel (q), elsewhere first here
        (``kv_transform.transform_qk``, which also centers k). The int4 pool goes through
        ``attention/triton_int4.py``."""
        if self._int4 is not None:
            return self._int4.forward(q, k, v, layer_id)
        meta = self.meta
        pool = self.pool
        kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
        ks, vs = pool.k_scales[layer_id], pool.v_scales[layer_id]
        table, slots, window = self._tables(layer_id)
        ksc, vsc = self._scale_caches(layer_id)
        k_mean = self._k_mean(layer_id)
        rotates = self._rotates()
        # prefill into token-minor V pages: the chunk store rotates k, the kernel rotates q
        fused_rotation = rotates and not kv_stored and self._v_t and not meta.is_decode
        if rotates and not kv_stored and not fused_rotation:
            q_dtype = q.dtype
            q, k = pool.kv_transform.transform_qk(layer_id, q, k)  # k - mu, then @ H
            q = q.to(q_dtype)  # k stays as returned (quantized from it in float32)
            k_mean = None
        q_bias = self._q_bias(layer_id, q, q_rotated=rotates and not fused_rotation)
        if kv_stored:
            pass  # the caller stored k/v at kv_store_target(layer_id)
        elif self._v_t and not meta.is_decode:
            store_kv_chunks(k, v, kc, vc, self._store_chunks, meta.cu_seqlens_q, meta.kv_lens,
                            table, pool.fmt, ks, vs, k_scale_cache=ksc,
                            v_scale_cache=vsc, k_mean=k_mean, rotate=fused_rotation)
        else:
            store_kv(k, v, kc, vc, slots, pool.fmt, ks, vs, pool.v_layout,
                     k_scale_cache=ksc, v_scale_cache=vsc, k_mean=k_mean)
        out = torch.empty_like(q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if meta.is_decode:
            cfg = self._decode_cfg if window is None else self._decode_cfg_swa
            if cfg.pack > 1 and q.shape[1] // kc.shape[1] > 16 // cfg.pack:
                cfg = dataclasses.replace(cfg, pack=1)  # a group too large to pack
            scratch = None  # static split-K scratch when it is large enough, else allocated
            n = q.shape[0] * q.shape[1] * cfg.num_splits
            if self._scratch is not None and cfg.num_splits > 1 and n <= self._scratch[1].shape[0]:
                scratch = (self._scratch[0][:n], self._scratch[1][:n], self._scratch[2])
            paged_decode(q, kc, vc, table, meta.kv_lens, out, self.sm_scale, cfg,
                         ks, vs, self.logit_softcap, window, scratch, ksc, vsc, q_bias)
        else:
            group = q.shape[1] // kc.shape[1]
            paged_prefill(q, kc, vc, table, meta.cu_seqlens_q, meta.kv_lens,
                          self._prefill_blocks(group), self._prefill_cfg, out, self.sm_scale,
                          ks, vs, self.logit_softcap, window, v_t=self._v_t, k_scale_cache=ksc,
                          v_scale_cache=vsc, q_bias=q_bias, rotate_q=fused_rotation,
                          split=self.extend_split if self._split_step and window is None
                          else None)
        return out

    # -- CUDA graphs ------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        """Allocate split-K scratch for ``max_bs`` decode rows at the most splits any batch size
        gets with contexts up to ``max_pages_per_req`` pages (static across replays)."""
        self._graph_max_len = max_pages_per_req * self.pool.page_size
        if self._int4 is not None:
            hq = self.num_q_heads or 16 * self.pool.layers[0].num_kv_heads
            self._int4.init_cuda_graph(max_bs, max_pages_per_req, hq)
            return
        if self._mla is not None:
            self._mla.init_cuda_graph(max_bs, max_pages_per_req)
            return
        hkv, d = self._layer_shape()
        for layer in range(self.pool.num_layers):  # K means on the device before any capture
            self._k_mean(layer)
        lens = [(self._graph_max_len, False)]  # (longest context, sliding layer)
        if self._window is not None:
            lens.append((min(self._graph_max_len, self._window), True))
        most = 1
        for bs in range(1, max_bs + 1):
            for max_len, sliding in lens:
                most = max(most, bs * self._decode_config(bs, max_len, sliding).num_splits)
        hq_max = 16 * hkv  # up to 16 query heads per KV head (larger: allocated per call)
        dev = self.pool.device
        self._scratch = (torch.empty((most * hq_max, d), dtype=torch.float32, device=dev),
                         torch.empty((most * hq_max,), dtype=torch.float32, device=dev),
                         # a fused merge's counts per (request, KV head): zero between calls
                         torch.zeros((max_bs * hkv,), dtype=torch.int32, device=dev))

    def prepare_cuda_graph(self, meta: AttentionMetadata) -> None:
        """Same as ``prepare`` for a decode batch, but with the split count fixed by batch size."""
        if self._graph_max_len is None:
            raise RuntimeError("init_cuda_graph must be called before prepare_cuda_graph")
        self.meta = meta
        if self._mla is not None:
            self._mla.prepare_cuda_graph(meta)
            return
        if self._int4 is not None:
            self._int4.prepare_cuda_graph(meta)
            return
        self._blocks = None
        self._prepare_decode(meta, self._graph_max_len)


    # -- CUDA graphs of prefill/extend steps ---------------------------------------------------
    supports_prefill_graph = True

    def prefill_graph_block_m(self) -> int:
        """Rows per prefill program (the graphs' fixed grid is counted in these)."""
        _, d = self._layer_shape()
        return prefill_config(d, self.compute_dtype, self.pool.dtype).block_m

    def init_prefill_graph(self, max_tokens: int, num_q_heads: int) -> None:
        """Reserve the split scratch for steps of ``max_tokens`` tokens (and eager steps up to
        ``SPLIT_MAX_TOKENS``) and freeze it (graphs capture its addresses). Mutates self."""
        if self._mla is not None:
            raise RuntimeError("prefill CUDA graphs cover MHA pools, not MLA latent slabs")
        _, d = self._layer_shape()
        for layer in range(self.pool.num_layers):  # K means on the device before any capture
            self._k_mean(layer)
        # graph buckets and eager steps split up to SPLIT_MAX_TOKENS tokens, never more:
        # room for them, never regrown
        self.extend_split.reserve(SPLIT_MAX_TOKENS, num_q_heads, d, self.pool.device)
        self.extend_split.frozen = True

    def prepare_prefill_graph(self, meta: AttentionMetadata, blocks: torch.Tensor,
                              chunks: torch.Tensor, group: int) -> None:
        """``prepare`` for a prefill step padded to a graph bucket: the program list and the V
        store chunks are the graph's static buffers (spare entries exit), and the full layers
        split their keys in buckets of up to ``SPLIT_MAX_TOKENS`` tokens (a block of a short
        context computes the same bits as without a split, so eager steps, which split only
        long contexts, agree); larger buckets attend unsplit, as eager steps of their size."""
        self.meta = meta
        _, d = self._layer_shape()
        self._prefill_cfg = prefill_config(d, self.compute_dtype, self.pool.dtype)
        self._q_lens = list(meta.q_lens_cpu)
        self._kv_lens = list(meta.kv_lens_cpu)
        self._blocks = {group: blocks}
        self._store_chunks = chunks
        self._split_step = meta.slot_mapping.shape[0] <= SPLIT_MAX_TOKENS  # the bucket's tokens


def _eight_bit(kv_dtype: str) -> bool:
    return kv_dtype.startswith("fp8") or kv_dtype == "int8"
