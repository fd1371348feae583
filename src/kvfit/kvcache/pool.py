"""KV pools: the GPU/CPU tensors that hold the paged KV cache, and how tokens are stored into them.

A pool owns its tensors and per-layer scales; it never decides which pages a request gets (the
``PageAllocator`` does, on the CPU). Slots are flat indices ``page * page_size + offset``; a slot
of -1 marks a padding token (CUDA-graph padding) that must not be stored.

Layout (HND): ``k_caches[layer]`` and ``v_caches[layer]`` are ``[num_pages, num_kv_heads,
page_size, head_dim]`` so one head's page is contiguous (what the decode kernels read).
``v_layout="HDN"`` stores V token-minor instead, ``[num_pages, num_kv_heads, head_dim,
page_size]``: the layout our fp8 decode kernel reads (P@V's reduction dim, the tokens, contiguous;
docs/kernels.md). Same bytes per page either way; K is always HND.

int8 pools (``fmt.scale_mode == "token_head"``) also hold ``k_scale_caches[layer]`` and
``v_scale_caches[layer]``, float16 ``[num_pages, num_kv_heads, page_size]``: one scale per token
and KV head (kvcache/quant.py ``quantize_int8_rows``); other pools have empty lists.
``kv_transform`` (kvcache/kv_transform.py) is the K centering / rotation the backend applies
before storing (None when off); the runner sets it after calibration, before any store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import torch

from kvfit.kvcache.dtypes import KV_FORMATS, KVFormat
from kvfit.kvcache.quant import dequantize, dequantize_int8_rows, quantize, quantize_int8_rows
from kvfit.kvcache.sizing import PoolSizing, SizingLimits, size_by_price
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token

if TYPE_CHECKING:
    from kvfit.kvcache.kv_transform import KVTransform
    from kvfit.kvcache.int4_residual import ResidualSlots
    from kvfit.kvcache.sliding_pages import SlidingWindowPages


class KVPool:
    """Base of all pools. Subclasses declare which layer kinds and KV formats they hold, and size
    themselves (``solve_pages`` -> ``PoolSizing`` -> ``from_sizing``), so no caller needs to know
    which pool it holds.

    ``sliding_pages`` is the pool's ``SlidingWindowPages`` when its sliding layers have a page
    space of their own (the scheduler drives it, the step metadata reads it), None otherwise.
    ``residual_slots`` likewise: the int4 pool's ``ResidualSlots`` (one full-precision partial
    page per running request, kvcache/int4_pool.py), None for every other pool.
    """

    name: ClassVar[str] = "KVPool"
    layer_kinds: ClassVar[frozenset[str]] = frozenset()
    # every format but int4 (``kivi``), which has a pool of its own (kvcache/int4_pool.py)
    supported_kv_dtypes: ClassVar[frozenset[str]] = frozenset(
        n for n, f in KV_FORMATS.items() if f.scale_mode != "kivi")
    v_layouts: ClassVar[frozenset[str]] = frozenset({"HND"})  # how V pages can be ordered
    # the only page size the pool can use, and why (None: any)
    page_size_required: ClassVar[Optional[int]] = None
    sliding_pages: Optional[SlidingWindowPages] = None
    residual_slots: Optional[ResidualSlots] = None
    kv_transform: Optional[KVTransform] = None  # K centering / rotation, set before any store
    # why this pool cannot store a KV dtype it leaves out of supported_kv_dtypes (for the guard)
    kv_dtype_refusals: ClassVar[dict[str, str]] = {
        "int4": "int4 has a pool of its own (Int4KVCache), for full-attention layers only"}
    # why full pages of this pool cannot be shared by prefix caching (None: they can)
    prefix_caching_refusal: ClassVar[Optional[str]] = None

    @classmethod
    def solve_pages(cls, layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                    limits: SizingLimits) -> PoolSizing:
        """How many pages this pool gets within ``limits`` (the price list of kvcache/spec.py);
        raises ``KVBudgetError`` naming the flags that help when nothing fits."""
        return size_by_price(layers, fmt, page_size, limits)

    @classmethod
    def from_sizing(cls, sizing: PoolSizing, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                    device: torch.device, k_scales: Optional[Sequence[float]] = None,
                    v_scales: Optional[Sequence[float]] = None, v_layout: str = "HND"):
        """The pool ``solve_pages`` sized (allocates its tensors)."""
        return cls(layers, sizing.num_pages, sizing.page_size, fmt, device, k_scales, v_scales,
                   v_layout=v_layout)

    def __init__(self, layers: Sequence[KVLayerSpec], num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device,
                 k_scales: Optional[Sequence[float]] = None,
                 v_scales: Optional[Sequence[float]] = None, v_layout: str = "HND"):
        if v_layout not in self.v_layouts:
            raise ValueError(f"v_layout must be one of {', '.join(sorted(self.v_layouts))} for the "
                             f"{self.name} pool, got {v_layout!r}")
        self.v_layout = v_layout  # how this pool's V pages are ordered
        self.layers = list(layers)
        self.num_layers = len(self.layers)
        self.num_pages = num_pages
        self.page_size = page_size
        self.fmt = fmt
        self.dtype = fmt.torch_dtype
        self.device = device
        self.k_scales = [1.0] * self.num_layers if k_scales is None else [float(s) for s in k_scales]
        self.v_scales = [1.0] * self.num_layers if v_scales is None else [float(s) for s in v_scales]
        if len(self.k_scales) != self.num_layers or len(self.v_scales) != self.num_layers:
            raise ValueError(f"KV scales need one value per layer ({self.num_layers}), got "
                             f"{len(self.k_scales)} k and {len(self.v_scales)} v")
        for s in (*self.k_scales, *self.v_scales):
            if not (s > 0 and s < float("inf")):
                raise ValueError(f"KV scales must be finite and > 0, got {s}")
        self.k_scale_caches: list[torch.Tensor] = []  # int8: [pages, H, P] float16 per layer
        self.v_scale_caches: list[torch.Tensor] = []
        self.token_scales = fmt.scale_mode == "token_head"

    def _add_layer_tensors(self, spec: KVLayerSpec, pages: int, make=torch.empty) -> None:
        """Allocate one K/V layer of ``pages`` pages (and its int8 scale pages) in this pool's
        format and V layout; appends to ``k_caches``/``v_caches`` (and the scale lists)."""
        shape = (pages, spec.num_kv_heads, self.page_size, spec.head_dim)
        vshape = shape if self.v_layout == "HND" else (*shape[:2], spec.head_dim, self.page_size)
        self.k_caches.append(make(shape, dtype=self.dtype, device=self.device))
        self.v_caches.append(make(vshape, dtype=self.dtype, device=self.device))
        if self.token_scales:
            for lst in (self.k_scale_caches, self.v_scale_caches):
                lst.append(make(shape[:3], dtype=torch.float16, device=self.device))

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def priced_bytes(self) -> int:
        """What the price list says this pool costs."""
        return self.num_tokens * spec_kv_bytes_per_token(self.layers, self.fmt)

    def allocated_bytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Replace the per-layer scales (only before any token is stored)."""
        self.k_scales = [float(s) for s in k_scales]
        self.v_scales = [float(s) for s in v_scales]


class MHAKVCache(KVPool):
    """Full-attention K and V for every layer (MHA/GQA/MQA models)."""

    name = "MHAKVCache"
    layer_kinds = frozenset({"full"})
    v_layouts = frozenset({"HND", "HDN"})

    def __init__(self, layers, num_pages, page_size, fmt, device, k_scales=None, v_scales=None,
                 v_layout: str = "HND"):
        super().__init__(layers, num_pages, page_size, fmt, device, k_scales, v_scales, v_layout)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for spec in self.layers:
            self._add_layer_tensors(spec, num_pages)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches,
                                                          *self.k_scale_caches,
                                                          *self.v_scale_caches))

    def store_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v ``[T, kv_heads, head_dim]`` into their slots, quantizing to the pool dtype.

        Mutates ``k_caches[layer_id]`` and ``v_caches[layer_id]``. Slots < 0 are skipped.
        """
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        page = slot_mapping // self.page_size
        off = slot_mapping % self.page_size
        if self.token_scales:  # int8: one float16 scale per (token, head) beside the page
            kq, ks = quantize_int8_rows(k)
            vq, vs = quantize_int8_rows(v)
            self.k_scale_caches[layer_id][page, :, off] = ks  # indexed view [T, kv_heads]
            self.v_scale_caches[layer_id][page, :, off] = vs
        else:
            kq = quantize(k, self.fmt, self.k_scales[layer_id])
            vq = quantize(v, self.fmt, self.v_scales[layer_id])
        # advanced indices around a slice: the indexed view is [T, kv_heads, head_dim]
        self.k_caches[layer_id][page, :, off] = kq
        if self.v_layout == "HND":
            self.v_caches[layer_id][page, :, off] = vq
        else:  # [pages, H, D, P]: the indexed view [T, H, D] takes the token's column
            self.v_caches[layer_id][page, :, :, off] = vq

    def gather_kv(self, layer_id: int, pages: torch.Tensor, length: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of a request whose page list is ``pages``, dequantized.

        Returns k, v ``[length, kv_heads, head_dim]`` in ``dtype`` (scale applied).
        """
        kc = self.k_caches[layer_id][pages]  # [n_pages, H, P, D]
        vc = self.v_caches[layer_id][pages]
        if self.v_layout == "HDN":
            vc = vc.transpose(2, 3)  # [n_pages, H, D, P] -> [n_pages, H, P, D]
        h, d = kc.shape[1], kc.shape[3]
        k = kc.transpose(1, 2).reshape(-1, h, d)[:length]  # [n_pages*P, H, D] -> [length, H, D]
        v = vc.transpose(1, 2).reshape(-1, h, d)[:length]
        if self.token_scales:
            ks = self.k_scale_caches[layer_id][pages].transpose(1, 2).reshape(-1, h)[:length]
            vs = self.v_scale_caches[layer_id][pages].transpose(1, 2).reshape(-1, h)[:length]
            return dequantize_int8_rows(k, ks, dtype), dequantize_int8_rows(v, vs, dtype)
        return (dequantize(k, dtype, self.k_scales[layer_id]),
                dequantize(v, dtype, self.v_scales[layer_id]))
