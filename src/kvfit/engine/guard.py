"""The start-up guard: check the whole (model, pool, backend, KV dtype, page size, device)
combination against what the pool and backends declare, before any weight is loaded.

No if-chains on names: each backend class lists its ``devices``, ``pools``, ``kv_dtypes``,
``page_sizes`` and ``head_dims``; each pool lists its ``supported_kv_dtypes``. A refused
combination raises ``UnsupportedCombinationError`` naming it and the backends that would work.
"""

from __future__ import annotations

from typing import Sequence

from kvfit.attention.registry import BACKENDS, backend_class, unavailable_reason
from kvfit.errors import UnsupportedCombinationError
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.spec import KVLayerSpec


def required_transforms(fmt: KVFormat) -> frozenset[str]:
    """The KV transforms (kvcache/kv_transform.py) a backend must apply to read ``fmt`` right:
    "rotate" for formats stored rotated (int8; its V rotation is folded into the weights, so a
    backend that ignored it would attend over rotated-only K). K centering is optional."""
    return frozenset({"rotate"}) if fmt.rotate else frozenset()


def _reasons(backend_name: str, pool_cls, fmt: KVFormat, page_size: int, device_type: str,
             head_dims: set[int], assume_installed: bool) -> list[str]:
    why = unavailable_reason(backend_name, device_type, assume_installed)
    if why:
        return [why]
    cls = backend_class(backend_name)
    out = []
    if pool_cls.name not in cls.pools:
        out.append(f"{backend_name} does not support the {pool_cls.name} pool "
                   f"(supports {', '.join(sorted(cls.pools))})")
    reads = cls.kv_dtypes_for(pool_cls.name)
    if fmt.name not in reads:
        why = cls.kv_dtype_refusals_for(pool_cls.name).get(fmt.name)
        out.append(f"{backend_name} does not read {fmt.name} KV "
                   + (f"in the {pool_cls.name} pool " if reads != cls.kv_dtypes else "")
                   + f"(reads {', '.join(sorted(reads))})" + (f": {why}" if why else ""))
    missing = required_transforms(fmt) - cls.kv_transforms
    if fmt.name in reads and missing:
        out.append(f"{backend_name} does not apply the {', '.join(sorted(missing))} transform "
                   f"{fmt.name} KV needs (kvcache/kv_transform.py)")
    if cls.page_sizes is not None and page_size not in cls.page_sizes:
        out.append(f"{backend_name} does not support page size {page_size} "
                   f"(supports {', '.join(map(str, sorted(cls.page_sizes)))})")
    wanted = {cls.v_layout(fmt.name, page_size, d, pool_cls.name) for d in head_dims}
    if pool_cls.name in cls.pools and not wanted <= pool_cls.v_layouts:
        out.append(f"{backend_name} reads {', '.join(sorted(wanted))} V pages, the "
                   f"{pool_cls.name} pool stores {', '.join(sorted(pool_cls.v_layouts))}")
    dims = cls.head_dims_for(pool_cls.name)
    if dims is not None and not head_dims <= dims:
        out.append(f"{backend_name} does not support head_dim {sorted(head_dims - dims)}"
                   f" (supports {', '.join(map(str, sorted(dims)))})")
    return out


def check_combination(backend_name: str, pool_cls, fmt: KVFormat, page_size: int,
                      device_type: str, layers: Sequence[KVLayerSpec],
                      assume_installed: bool = False) -> None:
    """Raise UnsupportedCombinationError unless the combination is implemented.
    ``assume_installed``: as on a machine of ``device_type`` with every backend's packages
    installed (``kvfit plan`` for a GPU, from any host)."""
    reasons = []
    if fmt.name not in pool_cls.supported_kv_dtypes:
        why = pool_cls.kv_dtype_refusals.get(fmt.name)
        reasons.append(f"the {pool_cls.name} pool does not store {fmt.name} "
                       f"(stores {', '.join(sorted(pool_cls.supported_kv_dtypes))})"
                       + (f": {why}" if why else ""))
    required = pool_cls.page_size_required
    pool_ok = not reasons and required in (None, page_size)
    if required not in (None, page_size):
        reasons.append(f"the {pool_cls.name} pool ({fmt.name}) needs pages of {required} tokens, "
                       f"its quantization group (K is quantized per channel over a whole page), "
                       f"not {page_size}: set --page-size {required} or leave it unset")
    head_dims = {l.head_dim for l in layers}
    reasons += _reasons(backend_name, pool_cls, fmt, page_size, device_type, head_dims,
                        assume_installed)
    if not reasons:
        return
    working = [b for b in BACKENDS if b != backend_name and pool_ok
               and not _reasons(b, pool_cls, fmt, page_size, device_type, head_dims,
                               assume_installed)]
    combo = (f"backend={backend_name}, pool={pool_cls.name}, kv_dtype={fmt.name}, "
             f"page_size={page_size}, device={device_type}")
    hint = (f"; these backends support it: {', '.join(working)} (--attention-backend)"
            if working else "; no backend here supports it: choose another --kv-dtype or "
            "--page-size")
    raise UnsupportedCombinationError(f"unsupported combination ({combo}): "
                                      + "; ".join(reasons) + hint)


def check_tensor_parallel(size: int, hf_config, model_cls, device_type: str,
                          kv_scales, devices_here: int | None) -> None:
    """Refuse a ``--tensor-parallel-size`` the model or the host cannot run, before any weight
    is loaded (raises UnsupportedCombinationError listing every reason and the fix).
    ``devices_here``: CUDA devices on this host (None when planning for another host).
    The model class says what its shapes allow (``tensor_parallel_refusals(hf_config, size)``);
    a class without that method is not sharded."""
    if size == 1:
        return
    refusals = getattr(model_cls, "tensor_parallel_refusals", None)
    if refusals is None:
        reasons = [f"{hf_config.model_type} runs on one GPU: its layers are not sharded "
                   f"(tensor parallelism shards Llama, Mistral, Qwen2/3, SmolLM2, Gemma 2/3 "
                   f"and DeepSeek-V2)"]
    else:
        reasons = list(refusals(hf_config, size))
    if kv_scales == "auto":
        reasons.append("--kv-scales auto calibrates on one rank; give a JSON file of scales")
    if device_type == "cuda" and devices_here is not None and devices_here < size:
        reasons.append(f"{size} ranks need {size} GPUs, this host has {devices_here}")
    if reasons:
        raise UnsupportedCombinationError(
            f"--tensor-parallel-size {size} is not supported here: " + "; ".join(reasons)
            + "; lower --tensor-parallel-size (1 runs the model on one device)")
