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


def unavailable_reason(name: str, device_type: str) -> str | None:
    """None when backend ``name`` can run on this device here, else why not."""
    try:
        cls = backend_class(name)
    except NotImplementedError as e:
        return str(e)
    if device_type not in cls.devices:
        return f"{name} runs on {', '.join(sorted(cls.devices))}, not {device_type}"
    return cls.is_available()


def select_backend(requested: str, device_type: str, pool_name: str | None = None) -> str:
    """``auto``: fi on CUDA when FlashInfer imports and holds ``pool_name``'s pool, else torch.
    Explicit names are kept (the guard then checks them)."""
    if requested != "auto":
        return requested
    if device_type == "cuda" and unavailable_reason("fi", "cuda") is None and (
            pool_name is None or pool_name in backend_class("fi").pools):
        return "fi"
    return "torch"
