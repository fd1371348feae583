"""Model inputs checked before anything heavy: GGUF files and the config fields a model class needs.

Owns no state. ``check_gguf_file(path)`` reads the header and tensor table (memory-mapped, no
tensor data) and checks every tensor lies inside the file. ``check_raw_config(d, path)`` checks a
config.json's ``model_type`` before transformers sees it. ``defaulted_fields(cfg, path, raw)``
lists the fields the library filled with its defaults (warnings); ``check_config(cfg, path,
raw)`` checks the consistency of heads, KV heads and sizes. Each failure raises ``ModelInputError`` naming the file,
the field and the fix.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

from kvfit.errors import ModelInputError

GGUF_MAGIC = b"GGUF"

# config fields each model family reads to build its layers (a missing one is filled with the
# transformers default, which is rarely the model's: warn)
_COMMON = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "vocab_size")
FIELDS_READ = {
    "llama": _COMMON, "mistral": _COMMON, "qwen2": _COMMON,
    "qwen3": _COMMON + ("head_dim",),
    "gemma2": _COMMON + ("head_dim",),
    "gemma3_text": _COMMON + ("head_dim", "sliding_window"),
    "deepseek_v2": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                    "v_head_dim"),
}
# families whose head size is hidden_size / num_attention_heads unless head_dim is given
_HEAD_DIM_FROM_HIDDEN = frozenset({"llama", "mistral", "qwen2"})


def check_gguf_file(path: str) -> None:
    """Raise ModelInputError unless ``path`` is a complete GGUF file (magic, header, metadata,
    tensor table, and every tensor's bytes inside the file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != GGUF_MAGIC:
        raise ModelInputError(
            f"{path} is not a GGUF file: it starts with {head[:4]!r}, not the GGUF magic bytes "
            f"{GGUF_MAGIC!r}; pass a .gguf model file (or a HF directory with config.json)")
    if len(head) < 24:
        raise ModelInputError(f"{path} is truncated: {size} bytes, shorter than a GGUF header "
                              f"(24 bytes); download or copy the file again")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise ModelInputError(f"{path}: GGUF version {version} is not supported (2 or 3); "
                              f"convert the model with a current llama.cpp")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged header
        raise ModelInputError(
            f"{path} is damaged or truncated ({size:,} bytes): its header ({n_kv} metadata "
            f"entries, {n_tensors} tensors) cannot be read ({type(e).__name__}: {e}); download "
            f"or copy the file again") from None
    if len(reader.tensors) != n_tensors:
        raise ModelInputError(f"{path}: the header announces {n_tensors} tensors but the table "
                              f"holds {len(reader.tensors)}; download or copy the file again")
    if "general.architecture" not in reader.fields:
        raise ModelInputError(f"{path} has no general.architecture metadata field; it is not a "
                              f"model file kvfit can load")
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        bad = next(t for t in reader.tensors if int(t.data_offset) + int(t.n_bytes) > size)
        raise ModelInputError(
            f"{path} is truncated: its tensors need {end:,} bytes but the file has {size:,} "
            f"(tensor {bad.name} ends at byte {int(bad.data_offset) + int(bad.n_bytes):,}); "
            f"download or copy the file again")


def check_raw_config(raw: dict, path: str, supported: list[str]) -> None:
    """A config.json's ``model_type`` is present and one kvfit has a model class for."""
    mt = raw.get("model_type")
    if mt is None:
        arch = raw.get("architectures") or []
        hint = f' (its architectures say {", ".join(arch)})' if arch else ""
        raise ModelInputError(
            f"{path} has no model_type field{hint}; add one, e.g. \"model_type\": \"qwen3\" "
            f"(supported: {', '.join(supported)})")
    if mt not in supported:
        raise ModelInputError(f"{path}: model_type {mt!r} is not supported by kvfit; supported: "
                              f"{', '.join(supported)}")


def defaulted_fields(cfg, path: str, raw: dict) -> list[str]:
    """One warning per field the model class reads that ``raw`` (the file's own dict) lacks,
    so the library's default was used."""
    mt = getattr(cfg, "model_type", None)
    return [f"{path} has no {name}; the transformers default for {mt} is used: "
            f"{name}={getattr(cfg, name)} (add \"{name}\" to the file if the model differs)"
            for name in FIELDS_READ.get(mt, ())
            if name not in raw and getattr(cfg, name, None) is not None]


def check_config(cfg, path: str, raw: Optional[dict] = None) -> None:
    """Check the fields the model class reads are consistent (heads, KV heads, sizes);
    ``raw`` (the file's own dict, when known) tells an explicit head_dim. Raises
    ModelInputError naming the file, the field and the fix."""
    mt = getattr(cfg, "model_type", None)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        v = getattr(cfg, name, None)
        if not isinstance(v, int) or v < 1:
            raise ModelInputError(f"{path}: {name} must be a positive integer, got {v!r}; fix "
                                  f"the field in the model's config")
    heads = cfg.num_attention_heads
    if mt != "deepseek_v2":
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if not isinstance(kv, int) or kv < 1:
            raise ModelInputError(f"{path}: num_key_value_heads must be a positive integer, got "
                                  f"{kv!r}")
        if kv > heads:
            raise ModelInputError(
                f"{path}: num_key_value_heads={kv} is more than num_attention_heads={heads}; "
                f"KV heads must be <= query heads: set num_key_value_heads to the model's value "
                f"(a divisor of {heads})")
        if heads % kv:
            raise ModelInputError(
                f"{path}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv}; each KV head serves a whole group of query heads: "
                f"set num_key_value_heads to a divisor of {heads}")
        explicit_head_dim = raw is not None and raw.get("head_dim") is not None
        if mt in _HEAD_DIM_FROM_HIDDEN and not explicit_head_dim and cfg.hidden_size % heads:
            raise ModelInputError(
                f"{path}: hidden_size={cfg.hidden_size} is not divisible by "
                f"num_attention_heads={heads}, and without head_dim the head size is "
                f"hidden_size / num_attention_heads; fix one of the two or add head_dim")
