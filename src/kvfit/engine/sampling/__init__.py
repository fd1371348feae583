"""Batched sampling: per-step parameter tensors (``SamplingBatch``), the sampler (``sample``),
counter-based per-request randomness (``randomness``) and logprob helpers."""

from kvfit.engine.sampling.batch import SamplingBatch
from kvfit.engine.sampling.sampler import (SamplerOutput, apply_token_bitmask, sample,
                                          top_logprobs, unpack_bitmask)

__all__ = ["SamplingBatch", "SamplerOutput", "apply_token_bitmask", "sample", "top_logprobs",
           "unpack_bitmask"]
