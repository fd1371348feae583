"""Named attention backends, imported lazily: a missing FlashInfer breaks only ``fi``."""

from __future__ import annotations

import importlib

BACKENDS = {
    "torch": "kvfit.attention.torch_ref:TorchRefBackend",
    "triton": "kvfit.attention.triton_backend:TritonBackend",
    "fi": "kvfit.attention.flashinfer_backend:FlashInferBackend",
}


def backend_class(name: str):
    """The class for a backend name; ValueError listing the known names for an unknown one."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    mod, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"attention backend {name!r} is not available ({e})") from e


def unavailable_reason(name: str, device_type: str, assume_installed: bool = False) -> str | None:
    """None when backend ``name`` can run on this device here, else why not.
    ``assume_installed``: judge only what the backend declares (its devices), as on a machine of
    that device type with its packages installed (``kvfit plan`` for a GPU from a CPU host)."""
    try:
        cls = backend_class(name)
    except NotImplementedError as e:
        return str(e)
    if device_type not in cls.devices:
        return f"{name} runs on {', '.join(sorted(cls.devices))}, not {device_type}"
    return None if assume_installed else cls.is_available()


def select_backend(requested: str, device_type: str, pool_name: str | None = None,
                   kv_dtype: str | None = None, head_dim: int | None = None,
                   assume_installed: bool = False) -> str:
    """``auto`` on CUDA: triton for fp8 KV with heads of >= 128 (its fp8 decode measured 1.2-2.2x
    FlashInfer's, docs/benchmarks.md) and for 16-bit KV with heads of 128 (decode 1.05-1.13x
    FlashInfer's, prefill graphs FlashInfer does not have: docs/benchmarks.md "bf16 KV on the
    triton backend"), and for MLA latent pools (FlashInfer's MLA decode kernel is 1.2-1.5x
    faster at 16-bit latents, but end to end fi was faster only at batch 64, slower at batch 1
    and 8; its fp8 path is slower than ours: docs/benchmarks.md "MLA through FlashInfer"),
    else fi when FlashInfer imports, else triton; each only
    if it holds ``pool_name``'s pool, heads of ``head_dim`` and reads ``kv_dtype``. torch
    otherwise. Explicit names are kept (the guard then checks them). ``assume_installed``: as on
    a machine where FlashInfer and Triton import."""
    if requested != "auto":
        return requested

    def usable(name: str) -> bool:
        if unavailable_reason(name, device_type, assume_installed) is not None:
            return False
        cls = backend_class(name)
        dims = cls.head_dims if pool_name is None else cls.head_dims_for(pool_name)
        reads = cls.kv_dtypes if pool_name is None else cls.kv_dtypes_for(pool_name)
        return ((pool_name is None or pool_name in cls.pools)
                and (head_dim is None or dims is None or head_dim in dims)
                and (kv_dtype is None or kv_dtype in reads))

    if device_type == "cuda":
        fp8_wide = (kv_dtype or "").startswith("fp8") and (head_dim or 0) >= 128
        wide16 = kv_dtype in ("bfloat16", "float16") and head_dim == 128
        mla = pool_name == "MLAKVCache"
        order = ("triton", "fi") if fp8_wide or wide16 or mla else ("fi", "triton")
        for name in order:
            if usable(name):
                return name
    return "torch"
