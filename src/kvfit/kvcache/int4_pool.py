"""Int4KVCache: the KIVI-style 4-bit pool (``--kv-dtype int4``) with its full-precision residual.

Per layer (HND, pages of 32 tokens = the K quantization group; kvcache/kivi.py quantizes):

* ``k_caches``  uint8 ``[num_pages, Hkv, P, D/2]``, ``k_scale_caches``/``k_zero_caches`` float16
  ``[num_pages, Hkv, D]`` (K per channel over the page's 32 tokens), the even channels' first,
  then the odd ones' (``kivi.evens_first``: what the low, then the high nibbles need);
* ``v_caches``  uint8 ``[num_pages, Hkv, P, D/2]``, ``v_scale_caches``/``v_zero_caches`` float16
  ``[num_pages, Hkv, P, D/32]`` (V per token in groups of 32 channels); with ``v_layout="HDN"``
  (token-minor V, what the register int4 decode reads: ``kernels/decode_int4_regs_kernel.py``)
  ``[num_pages, Hkv, D, P/2]`` (a byte holds two tokens of a channel, the even one in the low
  nibble) and ``[num_pages, Hkv, D/32, P]`` (``kivi.v_token_minor``);
* ``k_residual``/``v_residual`` ``[num_slots, Hkv, P, D]`` in the compute dtype: each running
  request's last, partial page (one slot per request, ``residual_slots``, assigned by the
  scheduler). A pool page is written once, when its 32 tokens are known, so only full
  (quantized) pages exist in the pool and prefix caching shares nothing else.

Every buffer is allocated once (static shapes). Sized by ``solve_pages``: the residual's fixed
cost (``kvcache/spec.residual_bytes``, ``max_num_seqs`` slots) comes off the budget first, the
rest is divided by the price of a token (0.625 bytes per element).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from kvfit.errors import KVBudgetError
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.int4_residual import ResidualPlan, ResidualSlots
from kvfit.kvcache.kivi import (GROUP, channel_order, dequantize_k_page, dequantize_v_tokens,
                                evens_first, quantize_k_page, quantize_v_tokens,
                                v_token_major, v_token_minor)
from kvfit.kvcache.pool import KVPool
from kvfit.kvcache.sizing import GiB, PoolSizing, SizingLimits
from kvfit.kvcache.spec import (KVLayerSpec, residual_bytes, solve_num_pages,
                                spec_kv_bytes_per_token)


@dataclass(frozen=True)
class Int4Sizing(PoolSizing):
    """A PoolSizing plus the residual buffer: ``residual_slots`` pages of K and V per layer in
    ``residual_dtype`` (``residual_bytes`` in all)."""

    residual_slots: int = 1
    residual_dtype: torch.dtype = torch.bfloat16
    residual_bytes: int = 0

    @property
    def pool_bytes(self) -> int:
        return self.tokens * self.bytes_per_token + self.residual_bytes

    def capacity_line(self, fmt: KVFormat, max_model_len: int, tp_size: int = 1,
                      full_layers=()) -> str:
        """The start-up line, with the residual buffer's share."""
        dtype = str(self.residual_dtype).replace("torch.", "")
        return (super().capacity_line(fmt, max_model_len, tp_size, full_layers)
                + f"; residual buffer {self.residual_slots} x {self.page_size} tokens in "
                  f"{dtype}, {self.residual_bytes / GiB:.3f} GiB (included)")


class Int4KVCache(KVPool):
    """int4 K and V of full-attention layers (MHA/GQA/MQA), full pages only, plus the residual."""

    name = "Int4KVCache"
    layer_kinds = frozenset({"full"})
    supported_kv_dtypes = frozenset({"int4"})
    v_layouts = frozenset({"HND", "HDN"})
    # the page is the K quantization group: only full pages are quantized
    page_size_required: ClassVar[Optional[int]] = GROUP

    @classmethod
    def solve_pages(cls, layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                    limits: SizingLimits) -> Int4Sizing:
        """Pages of the budget left after ``max_num_seqs`` residual slots (or the flags')."""
        bpt = spec_kv_bytes_per_token(layers, fmt)
        itemsize = torch.empty((), dtype=limits.compute_dtype).element_size()
        res = residual_bytes(layers, page_size, limits.max_num_seqs, itemsize)
        pages = limits.fixed_pages(page_size)
        if pages is None:
            if limits.budget_bytes is None:
                raise ValueError("Int4KVCache.solve_pages needs budget_bytes, num_pages or "
                                 "num_tokens")
            pages = solve_num_pages(max(0, limits.budget_bytes - res), layers, fmt, page_size)
            if pages < 1:
                raise KVBudgetError(
                    f"the KV budget of {limits.budget_bytes / GiB:.3f} GiB holds no int4 page of "
                    f"{page_size} tokens ({bpt * page_size} bytes) after the residual buffer of "
                    f"{limits.max_num_seqs} requests ({res / GiB:.3f} GiB, one full-precision "
                    f"page each); lower --max-num-seqs, raise --memory-ratio or set --num-pages")
        return Int4Sizing(pages, page_size, bpt, limits.max_num_seqs, limits.compute_dtype, res)

    @classmethod
    def from_sizing(cls, sizing: Int4Sizing, layers, fmt, device, k_scales=None, v_scales=None,
                    v_layout: str = "HND"):
        return cls(layers, sizing.num_pages, sizing.page_size, fmt, device, k_scales, v_scales,
                   v_layout, num_slots=sizing.residual_slots, residual_dtype=sizing.residual_dtype)

    def __init__(self, layers, num_pages, page_size, fmt, device, k_scales=None, v_scales=None,
                 v_layout: str = "HND", num_slots: int = 1,
                 residual_dtype: torch.dtype = torch.float32):
        super().__init__(layers, num_pages, page_size, fmt, device, k_scales, v_scales, v_layout)
        if page_size != GROUP:
            raise ValueError(f"the int4 pool needs pages of {GROUP} tokens (the K quantization "
                             f"group), got {page_size}")
        for spec in self.layers:
            if spec.kind != "full" or spec.head_dim % GROUP:
                raise ValueError(f"the int4 pool holds full-attention layers with head_dim a "
                                 f"multiple of {GROUP}, got {spec}")
        self.residual_dtype = residual_dtype
        self.residual_slots = ResidualSlots(num_slots)
        names = ("k_caches", "v_caches", "k_scale_caches", "k_zero_caches", "v_scale_caches",
                 "v_zero_caches", "k_residual", "v_residual")
        for n in names:
            setattr(self, n, [])
        for spec in self.layers:
            n, h, d = num_pages, spec.num_kv_heads, spec.head_dim
            u8 = dict(dtype=torch.uint8, device=device)
            f16 = dict(dtype=torch.float16, device=device)
            self.k_caches.append(torch.empty((n, h, page_size, d // 2), **u8))
            hdn = self.v_layout == "HDN"
            self.v_caches.append(torch.empty((n, h, d, page_size // 2) if hdn
                                             else (n, h, page_size, d // 2), **u8))
            self.k_scale_caches.append(torch.empty((n, h, d), **f16))
            self.k_zero_caches.append(torch.empty((n, h, d), **f16))
            vs = (n, h, d // GROUP, page_size) if hdn else (n, h, page_size, d // GROUP)
            self.v_scale_caches.append(torch.empty(vs, **f16))
            self.v_zero_caches.append(torch.empty(vs, **f16))
            res = (num_slots, h, page_size, d)
            self.k_residual.append(torch.empty(res, dtype=residual_dtype, device=device))
            self.v_residual.append(torch.empty(res, dtype=residual_dtype, device=device))
        self._tensor_names = names

    def priced_bytes(self) -> int:
        """Pages at the price list's bytes per token plus the residual buffer."""
        itemsize = torch.empty((), dtype=self.residual_dtype).element_size()
        return super().priced_bytes() + residual_bytes(self.layers, self.page_size,
                                                       self.residual_slots.num_slots, itemsize)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for n in self._tensor_names for t in getattr(self, n))

    # -- store ---------------------------------------------------------------------------
    def store_step(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   plan: ResidualPlan) -> None:
        """Store a step's k, v ``[T, Hkv, D]`` (compute dtype) as ``plan`` says: pages that fill
        are quantized whole (their earlier tokens read from the residual slot), the tokens of a
        new partial page go to the residual slot. Mutates this layer's pages, scales and
        residual; the staged pages are read before the residual is overwritten."""
        staged = self.stage_pages(layer_id, k, v, plan)
        if staged is not None:
            self.quantize_pages(layer_id, *staged, plan.full_pages)
        self.store_tail(layer_id, k, v, plan)

    def stage_pages(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                    plan: ResidualPlan) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The step's pages that fill, K and V ``[F, P, Hkv, D]`` in the residual's dtype (their
        earlier tokens from the residual slots, the rest from k, v), or None."""
        if not plan.num_full_pages:
            return None
        kres, vres = self.k_residual[layer_id], self.v_residual[layer_id]
        f, (_, h, p, d) = plan.num_full_pages, kres.shape
        ks = torch.empty((f, p, h, d), dtype=kres.dtype, device=kres.device)  # staged pages
        vs = torch.empty_like(ks)
        # advanced indices around a slice: residual[slot, :, off] is [R, H, D]
        ks[plan.stage_res_page, plan.stage_res_off] = kres[plan.stage_res_slot, :,
                                                            plan.stage_res_off]
        vs[plan.stage_res_page, plan.stage_res_off] = vres[plan.stage_res_slot, :,
                                                            plan.stage_res_off]
        ks[plan.stage_new_page, plan.stage_new_off] = k[plan.stage_new_tok].to(ks.dtype)
        vs[plan.stage_new_page, plan.stage_new_off] = v[plan.stage_new_tok].to(vs.dtype)
        return ks, vs

    def quantize_pages(self, layer_id: int, ks: torch.Tensor, vs: torch.Tensor,
                       pages: torch.Tensor) -> None:
        """Staged pages ``[F, P, Hkv, D]`` quantized into pool pages ``pages [F]`` (torch; the
        triton backend runs kernels/int4_store.py's ``int4_store_pages``, the same bytes)."""
        ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)  # [F, P, H, D] -> [F, H, P, D]
        kq, kscale, kzero = quantize_k_page(ks)
        vq, vscale, vzero = quantize_v_tokens(vs)
        if self.v_layout == "HDN":
            vq, vscale, vzero = v_token_minor(vq, vscale, vzero)
        self.k_caches[layer_id][pages] = kq
        self.k_scale_caches[layer_id][pages] = evens_first(kscale)
        self.k_zero_caches[layer_id][pages] = evens_first(kzero)
        self.v_caches[layer_id][pages] = vq
        self.v_scale_caches[layer_id][pages] = vscale
        self.v_zero_caches[layer_id][pages] = vzero

    def store_tail(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   plan: ResidualPlan) -> None:
        """The tokens of the step's new partial pages into their residual slots."""
        kres, vres = self.k_residual[layer_id], self.v_residual[layer_id]
        kres[plan.tail_slot, :, plan.tail_off] = k[plan.tail_tok].to(kres.dtype)
        vres[plan.tail_slot, :, plan.tail_off] = v[plan.tail_tok].to(vres.dtype)

    # -- read (torch reference) ------------------------------------------------------------
    def dequantize_v(self, layer_id: int, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """V of full pool pages ``pages`` of layer ``layer_id``, ``[n, Hkv, P, D]`` in ``dtype``
        (either V layout)."""
        vq, vs, vz = (self.v_caches[layer_id][pages], self.v_scale_caches[layer_id][pages],
                      self.v_zero_caches[layer_id][pages])
        if self.v_layout == "HDN":
            vq, vs, vz = v_token_major(vq, vs, vz)
        return dequantize_v_tokens(vq, vs, vz, dtype)

    def gather_kv(self, layer_id: int, pages: torch.Tensor, length: int, dtype: torch.dtype,
                  residual_slot: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of a request (page list ``pages``, residual slot
        ``residual_slot``): full pages dequantized, the partial page from the residual slot.

        Returns k, v ``[length, Hkv, D]`` in ``dtype``.
        """
        nfull, tail = divmod(length, self.page_size)
        full = pages[:nfull]
        k = dequantize_k_page(self.k_caches[layer_id][full],
                              channel_order(self.k_scale_caches[layer_id][full]),
                              channel_order(self.k_zero_caches[layer_id][full]),
                              dtype)  # [n, H, P, D]
        v = self.dequantize_v(layer_id, full, dtype)
        h, d = k.shape[1], k.shape[3]
        k = k.transpose(1, 2).reshape(-1, h, d)  # [n, H, P, D] -> [n*P, H, D]
        v = v.transpose(1, 2).reshape(-1, h, d)
        if tail:
            if residual_slot < 0:
                raise ValueError(f"{length} tokens end in a partial page: name the request's "
                                 "residual slot")
            kt = self.k_residual[layer_id][residual_slot, :, :tail].transpose(0, 1)  # [tail,H,D]
            vt = self.v_residual[layer_id][residual_slot, :, :tail].transpose(0, 1)
            k = torch.cat([k, kt.to(dtype)])
            v = torch.cat([v, vt.to(dtype)])
        return k, v
