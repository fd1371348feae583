"""The price list of the KV cache: bytes per token, and pages from a byte budget.

NOTE: this is the one function that prices KV bytes. The pools allocate exactly
``num_pages * page_size * spec_kv_bytes_per_token(...)`` bytes (tests check it to the byte), so the
token count logged at start is the token count that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from kvfit.kvcache.dtypes import KVFormat


@dataclass(frozen=True)
class KVLayerSpec:
    """What one attention layer keeps per token.

    kind:  ``full`` (every token), ``sliding`` (last ``window`` tokens), or ``mla`` (one latent
           slab of ``head_dim`` elements per token, num_kv_heads = 1, no separate V).
    """

    kind: Literal["full", "sliding", "mla"]
    num_kv_heads: int
    head_dim: int
    window: Optional[int] = None

    @property
    def elems_per_token(self) -> int:
        per_head = self.head_dim if self.kind == "mla" else 2 * self.head_dim  # K and V
        return self.num_kv_heads * per_head


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of ``page_size`` tokens that hold ``num_tokens`` tokens (rounded up)."""
    return -(-num_tokens // page_size)


def spec_kv_bytes_per_token(layers: Sequence[KVLayerSpec], fmt: KVFormat,
                            kinds: Optional[Sequence[str]] = None) -> int:
    """Bytes one token costs across ``layers`` (optionally only the given kinds) in format ``fmt``.

    Per-tensor scales live outside the pages and cost no bytes per token. ``kivi`` (int4, pages
    of 32 tokens) stores per head and token D/2 bytes of K and V codes each, K's float16 scale and
    zero per channel and page (4D/32 bytes per token) and V's per token and 32 channels (4D/32):
    5D/4 bytes for 2D elements, 0.625 bytes per element. The int4 pool's residual buffer (full
    precision, fixed size) is priced by ``residual_bytes``.
    """
    elems = sum(l.elems_per_token for l in layers if kinds is None or l.kind in kinds)
    if fmt.scale_mode == "kivi":
        return elems * 5 // 8  # head_dim is a multiple of 32 (the int4 pool checks it)
    return elems * fmt.itemsize


def residual_bytes(layers: Sequence[KVLayerSpec], page_size: int, num_slots: int,
                   itemsize: int) -> int:
    """The int4 pool's fixed cost: one full-precision page of K and V per layer for each of
    ``num_slots`` running requests, ``itemsize`` bytes per element (the compute dtype)."""
    return sum(l.elems_per_token for l in layers) * page_size * num_slots * itemsize


def solve_num_pages(budget_bytes: int, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                    page_size: int) -> int:
    """The most pages of ``page_size`` tokens that fit in ``budget_bytes``."""
    per_page = spec_kv_bytes_per_token(layers, fmt) * page_size
    if per_page <= 0:
        raise ValueError("model has no KV layers to price")
    return max(0, budget_bytes // per_page)
