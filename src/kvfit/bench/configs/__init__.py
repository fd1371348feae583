"""Hugging Face ``config.json`` files of real models (shapes only, no weights), shipped as package
data: ``kvfit bench seed`` runs Qwen3-1.7B's shape with random weights by default, and
``kvfit plan`` prices any of them. ``config_path("qwen3-1.7b")`` is the file's path on disk.
"""

from __future__ import annotations

import os

_DIR = os.path.dirname(os.path.abspath(__file__))
NAMES = ("qwen3-1.7b", "deepseek-v2-lite", "llama-3.1-8b")


def config_path(name: str) -> str:
    """Path of the shipped ``<name>.json``; an unknown name is a ValueError listing the known."""
    if name not in NAMES:
        raise ValueError(f"no shipped config {name!r}; known: {', '.join(NAMES)}")
    return os.path.join(_DIR, f"{name}.json")
