"""The one table of KV-cache element types.

Every place that needs to know what a KV dtype name means (its torch dtype, its element size,
its finite range, whether it is quantized) reads it from here. Adding a format means adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the paged KV cache.

    name:       the canonical flag value (``fp8_e4m3``).
    torch_dtype: the element type of the pool tensors.
    quantized:  True when storing needs a scale and saturation (the value range is narrow).
    max_finite: the largest finite magnitude of the format; values are clamped to it on store.
    scale_mode: where the scales live: ``tensor`` (one float per layer, outside the pages:
                16-bit and fp8), ``token_head`` (int8: one float16 scale per token and KV head,
                in ``k_scale_caches``/``v_scale_caches`` beside the pages, priced per token) or
                ``kivi`` (int4: K per channel over a page of 32 tokens, V per token in groups of
                32 channels, asymmetric fp16 scale and zero, kvcache/kivi.py; ``torch_dtype`` is
                the packed storage byte, two 4-bit codes per uint8).
    rotate:     K and V are Hadamard-rotated per head before quantizing (kvcache/kv_transform.py;
                int8: it spreads outlier channels over the row; measured unsafe for fp8).
    """

    name: str
    torch_dtype: torch.dtype
    quantized: bool
    max_finite: float
    scale_mode: str = "tensor"
    rotate: bool = False

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()


KV_FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32, False, torch.finfo(torch.float32).max),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, False, torch.finfo(torch.bfloat16).max),
    "float16": KVFormat("float16", torch.float16, False, torch.finfo(torch.float16).max),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, True, torch.finfo(torch.float8_e4m3fn).max),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, True, torch.finfo(torch.float8_e5m2).max),
    # symmetric int8, one fp16 scale per (token, KV head); K centered and K/V Hadamard-rotated
    # first (kvcache/kv_transform.py); quantize/dequantize in kvcache/quant.py
    "int8": KVFormat("int8", torch.int8, True, 127.0, scale_mode="token_head", rotate=True),
    # 4-bit codes 0..15, two per byte; the pool keeps the last partial page in full precision
    "int4": KVFormat("int4", torch.uint8, True, 15.0, scale_mode="kivi"),
}

# Names a user may type for --kv-dtype. ``auto`` follows the model dtype; ``fp8`` means e4m3 as in
# vLLM. float32 is reachable only through ``auto`` with a float32 model (CPU default).
KV_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

_TORCH_TO_NAME = {fmt.torch_dtype: name for name, fmt in KV_FORMATS.items()}


def kv_format(name: str) -> KVFormat:
    """The format for a canonical or alias name; ValueError listing valid names otherwise."""
    canon = _ALIASES.get(name, name)
    if canon not in KV_FORMATS:
        raise ValueError(
            f"unknown KV dtype {name!r}; valid: {', '.join(KV_DTYPE_CHOICES)}"
        )
    return KV_FORMATS[canon]


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """``auto`` -> the model dtype's format, anything else -> its own format."""
    if kv_dtype == "auto":
        return KV_FORMATS[_TORCH_TO_NAME[model_dtype]]
    return kv_format(kv_dtype)
