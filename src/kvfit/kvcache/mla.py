"""MLAKVCache: the paged latent cache of Multi-head Latent Attention (DeepSeek-V2/V3).

Per layer and token MLA keeps one slab of ``kv_lora_rank + qk_rope_head_dim`` elements: the
RMS-normalized compressed KV latent ``c`` followed by the shared rotary key ``k_pe``. Keys and
values of every head are linear maps of ``c`` (``kv_b_proj``), so nothing else is stored: with the
weight-absorbed form the attention runs directly on the slab (keys = the whole slab, values = its
first ``kv_lora_rank`` elements; see attention/torch_mla.py).

Layout: ``kv_caches[layer]`` is ``[num_pages, page_size, slab]`` (FlashMLA's single-slab layout
without the head axis). Layer specs are ``KVLayerSpec("mla", 1, slab)``, so the price list
(``spec_kv_bytes_per_token``) charges ``slab * itemsize`` bytes per token and layer.

Scales: one per-tensor scale per layer, ``k_scales[layer]``, for the whole slab (quantize on store
saturates, so fp8 never stores NaN/Inf). ``v_scales`` has no separate meaning here; passing values
different from ``k_scales`` is an error rather than silently ignored.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfit.kvcache.dtypes import KV_FORMATS, KVFormat
from kvfit.kvcache.pool import KVPool
from kvfit.kvcache.quant import dequantize, quantize
from kvfit.kvcache.spec import KVLayerSpec


class MLAKVCache(KVPool):
    """Latent + rope-key slabs for every MLA layer. Mutates ``kv_caches`` in ``store_latent``."""

    name = "MLAKVCache"
    layer_kinds = frozenset({"mla"})
    supported_kv_dtypes = frozenset(n for n, f in KV_FORMATS.items() if f.scale_mode == "tensor")
    kv_dtype_refusals = {
        **KVPool.kv_dtype_refusals,  # int4
        "int8": "int8 KV relies on a per-head Hadamard rotation of V folded into v_proj/o_proj "
                "and on K centering per KV head; MLA's latent slab is both K and V of every "
                "head (and its rope part is shared), so neither applies: use fp8_e4m3 for MLA "
                "models"}

    def __init__(self, layers: Sequence[KVLayerSpec], num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device, k_scales=None, v_scales=None,
                 v_layout: str = "HND"):
        if v_scales is not None and k_scales is not None and list(map(float, v_scales)) != list(
                map(float, k_scales)):
            raise ValueError("MLAKVCache has one scale per layer (k_scales) for the latent slab; "
                             "v_scales must be omitted or equal to k_scales")
        super().__init__(layers, num_pages, page_size, fmt, device, k_scales,
                         k_scales if v_scales is None else v_scales, v_layout)
        for spec in self.layers:
            if spec.kind != "mla" or spec.num_kv_heads != 1:
                raise ValueError(f"MLAKVCache holds only KVLayerSpec('mla', 1, slab) layers, got "
                                 f"{spec}; use resolve_pool_class to pick the pool")
        self.kv_caches: list[torch.Tensor] = [
            torch.empty((num_pages, page_size, spec.head_dim), dtype=self.dtype, device=device)
            for spec in self.layers]

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def set_scales(self, k_scales, v_scales=None) -> None:
        super().set_scales(k_scales, k_scales if v_scales is None else v_scales)

    def store_latent(self, layer_id: int, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write slabs ``kv [T, slab]`` into their slots (quantized). Slots < 0 are skipped."""
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            kv, slot_mapping = kv[valid], slot_mapping[valid]
        page = slot_mapping // self.page_size
        off = slot_mapping % self.page_size
        self.kv_caches[layer_id][page, off] = quantize(kv, self.fmt, self.k_scales[layer_id])

    def gather_latent(self, layer_id: int, pages: torch.Tensor, length: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """The first ``length`` slabs of a request with page list ``pages``: ``[length, slab]``."""
        c = self.kv_caches[layer_id][pages]  # [n_pages, P, slab]
        c = c.reshape(-1, c.shape[-1])[:length]  # [length, slab]
        return dequantize(c, dtype, self.k_scales[layer_id])
