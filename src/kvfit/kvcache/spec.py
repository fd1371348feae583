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

    @property
    def rows_per_token(self) -> int:
        """Vectors of ``head_dim`` one token stores: K and V per KV head (one slab for MLA)."""
        return self.num_kv_heads * (1 if self.kind == "mla" else 2)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of ``page_size`` tokens that hold ``num_tokens`` tokens (rounded up)."""
    return -(-num_tokens // page_size)


def spec_kv_bytes_per_token(layers: Sequence[KVLayerSpec], fmt: KVFormat,
                            kinds: Optional[Sequence[str]] = None) -> int:
    """Bytes one token costs across ``layers`` (optionally only the given kinds) in format ``fmt``.

    Per-tensor scales (``scale_mode`` "tensor") live outside the pages and cost no bytes per
    token. ``token_head`` (int8) adds one float16 scale per stored row: per layer and token
    ``2 * Hkv * (D + 2)`` bytes. ``kivi`` (int4, pages of 32 tokens) stores per head and token
    D/2 bytes of K and V codes each, K's float16 scale and zero per channel and page (4D/32
    bytes per token) and V's per token and 32 channels (4D/32): 5D/4 bytes for 2D elements,
    0.625 bytes per element. The int4 pool's residual buffer (full precision, fixed size) is
    priced by ``residual_bytes``.
    """
    chosen = [l for l in layers if kinds is None or l.kind in kinds]
    if fmt.scale_mode == "kivi":  # head_dim is a multiple of 32 (the int4 pool checks it)
        return sum(l.elems_per_token for l in chosen) * 5 // 8
    data = sum(l.elems_per_token for l in chosen) * fmt.itemsize
    return data + sum(scale_bytes_per_token(l, fmt) for l in chosen)


def residual_bytes(layers: Sequence[KVLayerSpec], page_size: int, num_slots: int,
                   itemsize: int) -> int:
    """The int4 pool's fixed cost: one full-precision page of K and V per layer for each of
    ``num_slots`` running requests, ``itemsize`` bytes per element (the compute dtype)."""
    return sum(l.elems_per_token for l in layers) * page_size * num_slots * itemsize


SCALE_ITEMSIZE = 2  # float16 scales


def scale_bytes_per_token(layer: KVLayerSpec, fmt: KVFormat) -> int:
    """The scale bytes one token costs on ``layer`` in ``fmt`` (0 for per-tensor scales)."""
    if fmt.scale_mode == "tensor":
        return 0
    if fmt.scale_mode == "token_head":
        return layer.rows_per_token * SCALE_ITEMSIZE
    if fmt.scale_mode == "kivi":  # scale + zero: K's per channel and page of 32, V's per 32
        return layer.elems_per_token // 8
    raise ValueError(f"no price for the {fmt.scale_mode!r} scales of {fmt.name}")


def solve_num_pages(budget_bytes: int, layers: Sequence[KVLayerSpec], fmt: KVFormat,
                    page_size: int) -> int:
    """The most pages of ``page_size`` tokens that fit in ``budget_bytes``."""
    per_page = spec_kv_bytes_per_token(layers, fmt) * page_size
    if per_page <= 0:
        raise ValueError("model has no KV layers to price")
    return max(0, budget_bytes // per_page)
