"""Hugging Face ``config.json`` files of real models (shapes only, no weights), shipped as package
data: ``kvfit bench seed`` runs Qwen3-1.7B's shape with random weights by default, and
``kvfit plan`` prices any of them. ``gemma3-270m`` is the Gemma-3-270M GGUF's configuration (as
transformers reads it from the installed package's file); ``gemma3-4b`` is Gemma 3 4B's text
decoder (34 layers, 5 sliding-window layers of 1024 tokens : 1 full, linear RoPE x8 on the full
layers). ``config_path("qwen3-1.7b")`` is the file's path on disk.
"""

from __future__ import annotations

import os

_DIR = os.path.dirname(os.path.abspath(__file__))
NAMES = ("qwen3-1.7b", "deepseek-v2-lite", "llama-3.1-8b", "gemma3-270m", "gemma3-4b")


def config_path(name: str) -> str:
    """Path of the shipped ``<name>.json``; an unknown name is a ValueError listing the known."""
    if name not in NAMES:
        raise ValueError(f"no shipped config {name!r}; known: {', '.join(NAMES)}")
    return os.path.join(_DIR, f"{name}.json")
