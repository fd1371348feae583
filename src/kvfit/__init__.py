"""kvfit: an LLM inference engine whose paged KV cache stores the element type you choose."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name):  # lazy: `import kvfit` stays light (no model code, no torch kernels)
    if name == "LLM":
        from kvfit.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvfit.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from kvfit.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
