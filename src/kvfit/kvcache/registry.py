"""resolve_pool_class: which KV pool a model needs, from its layer specs (lazy imports)."""

from __future__ import annotations

import importlib
from typing import Sequence

from kvfit.kvcache.spec import KVLayerSpec

POOLS = {
    "MHAKVCache": "kvfit.kvcache.pool:MHAKVCache",
    "HybridSWAKVCache": "kvfit.kvcache.hybrid_swa:HybridSWAKVCache",
    "MLAKVCache": "kvfit.kvcache.mla:MLAKVCache",
}


def pool_name_for(layers: Sequence[KVLayerSpec]) -> str:
    kinds = {l.kind for l in layers}
    if "mla" in kinds:
        return "MLAKVCache"
    if "sliding" in kinds:
        return "HybridSWAKVCache"
    return "MHAKVCache"


def pool_class(name: str):
    mod, cls = POOLS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"KV pool {name} is not available in this build ({e})") from e


def resolve_pool_class(layers: Sequence[KVLayerSpec]):
    """MHAKVCache for full attention, HybridSWAKVCache with sliding layers, MLAKVCache for MLA."""
    return pool_class(pool_name_for(layers))
