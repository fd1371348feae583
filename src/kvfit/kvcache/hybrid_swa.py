"""HybridSWAKVCache: a pool for models that mix full-attention and sliding-window layers (Gemma 2/3,
Mistral-style windows), where the windowed layers keep only the last ``window`` tokens per request.

Two page spaces
---------------
Full layers and sliding layers live in separate page spaces of the same ``page_size``:

* full layers: ``k_caches[l]``/``v_caches[l]`` are ``[num_pages, H, P, D]`` (V ``[.., D, P]`` with
  ``v_layout="HDN"``, as in MHAKVCache); a request's pages come
  from the engine's ``PageAllocator`` exactly as for ``MHAKVCache`` (every token keeps its slot).
* sliding layers: ``[num_swa_pages + 1, H, P, D]``; pages come from ``pool.sliding_pages``
  (a ``SlidingWindowPages``, kvcache/sliding_pages.py: its own allocator plus one *logical* page
  list per request, with holes where pages fell out of the window). The extra page
  ``null_page = num_swa_pages`` is zero-filled and never handed out: the step metadata
  (``attention/meta_builder.build_hybrid_metadata``) writes freed entries as the null page, so GPU
  kernels that apply the window mask read at most its finite zeros, masked out.

KV dtypes: every format of kvcache/dtypes.py, per-layer K and V scales; the store is the
saturating ``quantize`` (fp8 never stores NaN/Inf). Tested tolerances: stored elements within
2^-4 (e4m3) / 2^-3 (e5m2) relative (+ one subnormal step x scale) of the clamped input; tiny
random Gemma logits within 5% / 10% of the bf16-cache logits' scale; real Gemma-3-270M top-1
agreement with the float32 cache >= 0.9 (e4m3) past the window (tests/test_swa_pool.py,
tests/test_gemma3.py).

Two modes, fixed at construction
--------------------------------
* windowed (``num_swa_pages`` given; what the engine uses, sized by ``solve_pages``): as above.
  Backends (torch, triton) must read the sliding layers' tables from ``meta.swa``; metadata
  without them is refused with an error (never a silent read of the wrong page space).
* shared (``num_swa_pages=None``; throwaway pools for activation profiling and scale
  calibration): sliding layers use the full layers' page ids (tensors ``[num_pages, ...]``),
  nothing is released, the window is applied as a mask only, and the price is MHAKVCache's.
  ``sliding_pages`` is None.

Price: full layers per token, sliding layers per running request (``kvcache/sizing.py``,
``solve_hybrid_pages``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.pool import KVPool, MHAKVCache
from kvfit.kvcache.sizing import HybridBudget, SizingLimits, hybrid_pool_bytes, solve_hybrid_pages
from kvfit.kvcache.sliding_pages import SlidingWindowPages
from kvfit.kvcache.spec import KVLayerSpec


class HybridSWAKVCache(KVPool):
    """K/V for full layers (every token) and sliding layers (last ``window`` tokens per request).

    Owns its tensors, its per-layer scales and ``sliding_pages`` (see the module docstring).
    ``store_kv``/``gather_kv`` take slots/pages of the layer's own page space: the backend picks
    ``meta.swa`` for sliding layers and the plain tables otherwise.
    """

    name = "HybridSWAKVCache"
    layer_kinds = frozenset({"full", "sliding"})
    v_layouts = frozenset({"HND", "HDN"})  # as MHAKVCache: V pages token-major or token-minor
    prefix_caching_refusal = ("its sliding-window layers give pages back as the window slides, "
                              "so a finished prompt's early window pages are gone")

    @classmethod
    def solve_pages(cls, layers: Sequence[KVLayerSpec], fmt: KVFormat, page_size: int,
                    limits: SizingLimits) -> HybridBudget:
        """Split the budget between full-layer pages and sliding pages (``solve_hybrid_pages``);
        pages fixed by flags keep the uncapped sliding reservation."""
        return solve_hybrid_pages(limits.budget_bytes or 0, layers, fmt, page_size,
                                  limits.max_num_seqs, limits.max_num_batched_tokens,
                                  num_pages=limits.fixed_pages(page_size))

    @classmethod
    def from_sizing(cls, sizing: HybridBudget, layers, fmt, device, k_scales=None,
                    v_scales=None, v_layout: str = "HND"):
        """The windowed pool ``solve_pages`` sized."""
        return cls(layers, sizing.num_pages, sizing.page_size, fmt, device, k_scales, v_scales,
                   num_swa_pages=sizing.num_swa_pages, v_layout=v_layout)

    def __init__(self, layers: Sequence[KVLayerSpec], num_pages: int, page_size: int,
                 fmt: KVFormat, device: torch.device, k_scales=None, v_scales=None,
                 num_swa_pages: Optional[int] = None, v_layout: str = "HND"):
        super().__init__(layers, num_pages, page_size, fmt, device, k_scales, v_scales, v_layout)
        windows = {l.window for l in self.layers if l.kind == "sliding"}
        if not windows or None in windows:
            raise ValueError("HybridSWAKVCache needs sliding layers with a window; use MHAKVCache")
        if num_swa_pages is not None and num_swa_pages < 1:
            raise ValueError("num_swa_pages must be >= 1 (see solve_hybrid_pages), or None for "
                             "the shared mode")
        self.window = max(windows)
        self.num_swa_pages = num_swa_pages
        self.null_page = num_swa_pages
        if num_swa_pages is not None:
            self.sliding_pages = SlidingWindowPages(num_swa_pages, page_size, self.window)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for spec in self.layers:
            if spec.kind == "full" or num_swa_pages is None:
                self._add_layer_tensors(spec, num_pages)
            else:  # sliding: zeros so that the null page reads finite
                self._add_layer_tensors(spec, num_swa_pages + 1, make=torch.zeros)

    def priced_bytes(self) -> int:
        if self.sliding_pages is None:
            return super().priced_bytes()
        return hybrid_pool_bytes(self.layers, self.fmt, self.page_size, self.num_pages,
                                 self.num_swa_pages)

    allocated_bytes = MHAKVCache.allocated_bytes

    # same per-layer tensor layout as MHAKVCache: reuse its store and gather
    store_kv = MHAKVCache.store_kv
    gather_kv = MHAKVCache.gather_kv
