"""resolve_pool_class: which KV pool a model needs, from its layer specs (lazy imports)."""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.spec import KVLayerSpec

POOLS = {
    "MHAKVCache": "kvfit.kvcache.pool:MHAKVCache",
    "HybridSWAKVCache": "kvfit.kvcache.hybrid_swa:HybridSWAKVCache",
    "MLAKVCache": "kvfit.kvcache.mla:MLAKVCache",
    "Int4KVCache": "kvfit.kvcache.int4_pool:Int4KVCache",
}


def pool_name_for(layers: Sequence[KVLayerSpec], fmt: Optional[KVFormat] = None) -> str:
    """The pool for the layers' kinds; int4 KV (``kivi`` scales) of full-attention models gets
    ``Int4KVCache`` (other pools refuse int4 in the guard, naming what they store)."""
    kinds = {l.kind for l in layers}
    if "mla" in kinds:
        return "MLAKVCache"
    if "sliding" in kinds:
        return "HybridSWAKVCache"
    if fmt is not None and fmt.scale_mode == "kivi":
        return "Int4KVCache"
    return "MHAKVCache"


def pool_class(name: str):
    mod, cls = POOLS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"KV pool {name} is not available in this build ({e})") from e


def resolve_pool_class(layers: Sequence[KVLayerSpec], fmt: Optional[KVFormat] = None):
    """MHAKVCache for full attention (Int4KVCache for int4 KV), HybridSWAKVCache with sliding
    layers, MLAKVCache for MLA."""
    return pool_class(pool_name_for(layers, fmt))
