"""SamplingBatch: the per-row sampling parameters of one step, as device tensors built once.

Built on the host from the requests that sample this step (one list pass, no device work but one
packed host-to-device copy); read by ``sample``. Host-side flags (all greedy, which rows need the
sorted candidates, how many candidates, which rows want logprobs) let the sampler skip work
without ever asking the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from kvfit.engine.sampling.randomness import uniforms
from kvfit.sampling_params import SamplingParams
from kvfit.transfer import to_device

_GREEDY_BELOW = 1e-5


def _param_view(row: int, convert) -> functools.cached_property:
    """A lazily built ``convert(params[row])`` (the batch is frozen; the cache is per object)."""
    return functools.cached_property(lambda self: convert(self.params[row]))


def _rows_view(field: str) -> functools.cached_property:
    """The host row indices ``field`` as a device int64 tensor, or None when there are none
    (one host->device copy, on first use only)."""
    def rows(self) -> Optional[torch.Tensor]:
        host = getattr(self, field)
        return to_device(host.astype(np.int64), self.device) if host.size else None
    return functools.cached_property(rows)


@dataclass(frozen=True)
class SamplingBatch:
    """Row i describes the request whose logits are row i of the step's sample logits."""

    num_rows: int
    vocab_size: int
    # device float64 [6, N]: temperature (1.0 on greedy rows), top_p (1 when off), min_p (0 when
    # off), top_k (V when off), greedy (1.0: temperature < 1e-5, argmax), uniform (the draw, a
    # function of (seed, position)); None when every row is greedy. One host->device copy.
    params: Optional[torch.Tensor]
    # host-side decisions (no device sync needed to make them)
    all_greedy: bool
    any_greedy: bool
    any_min_p: bool
    # row indices (host int64 arrays; as device tensors below, copied on first use): rows
    # needing sorted candidates (top-k/top-p), and the same rows split for the CUDA draw into
    # top-k rows and rows with top-p alone (the sort-free cutoff of kernels/sampling.py)
    sort_rows_host: np.ndarray  # [S]
    num_candidates: int  # candidates per sort row: max top-k, or V if a row has top-p alone
    top_k_rows_host: np.ndarray  # [K]
    top_k_candidates: int  # the max top-k of the top-k rows
    top_p_rows_host: np.ndarray  # [R]
    device: torch.device
    # logit_bias as a sparse list of (row, token, bias); None when no row has one
    bias_rows: Optional[torch.Tensor]
    bias_tokens: Optional[torch.Tensor]
    bias_values: Optional[torch.Tensor]
    # rows that asked for logprobs, and how many top alternatives each wants
    logprob_rows: list[int]
    logprob_counts: list[int]
    logprob_index: Optional[torch.Tensor]  # int64 [M] on the device: logprob_rows

    # per-row views of ``params`` in the dtypes the torch path computes with (built on first
    # use: the fused CUDA draw reads ``params`` itself and never needs them), [N] each
    temperature = _param_view(0, torch.Tensor.float)
    top_p = _param_view(1, torch.Tensor.float)
    min_p = _param_view(2, torch.Tensor.float)
    top_k = _param_view(3, torch.Tensor.long)
    greedy = _param_view(4, lambda t: t > 0.5)

    sort_rows = _rows_view("sort_rows_host")
    top_k_rows = _rows_view("top_k_rows_host")
    top_p_rows = _rows_view("top_p_rows_host")

    @property
    def uniform(self) -> torch.Tensor:
        return self.params[5]  # [N] float64

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              vocab_size: int, device: torch.device | str) -> "SamplingBatch":
        """params/seeds/positions per row: the request's parameters, its 64-bit sampling seed and
        the position (index in prompt + output) of the token being sampled."""
        n, v = len(params), vocab_size
        raw = np.array([(p.temperature, p.top_p, p.min_p, p.top_k) for p in params],
                       dtype=np.float64).reshape(n, 4)
        # greedy rows filter nothing; as in vLLM, temperatures below 1e-5 are greedy (x / T would
        # overflow float32 and the distribution is the argmax anyway)
        greedy = raw[:, 0] < _GREEDY_BELOW
        all_greedy = bool(greedy.all())
        dev = torch.device(device)
        packed = None  # an all-greedy step needs no per-row tensors: argmax only
        any_min_p, sort_rows, k_max = False, np.zeros(0, dtype=np.int64), 0
        top_k_rows, top_p_rows, k_max_topk = sort_rows, sort_rows, 0
        if not all_greedy:
            temperature = np.where(greedy, 1.0, raw[:, 0])
            top_p = np.where(greedy, 1.0, raw[:, 1])
            min_p = np.where(greedy, 0.0, raw[:, 2])
            top_k = np.where(greedy | (raw[:, 3] <= 0), v, np.minimum(raw[:, 3], v))
            sort_mask = (top_k < v) | (top_p < 1.0)
            sort_rows = np.flatnonzero(sort_mask)
            need_full = bool((sort_mask & (top_k >= v)).any())  # top-p alone sees all tokens
            k_max = v if need_full else int(top_k[sort_rows].max(initial=0))
            top_k_rows = np.flatnonzero(top_k < v)
            top_p_rows = np.flatnonzero(sort_mask & (top_k >= v))
            k_max_topk = int(top_k[top_k_rows].max(initial=0))
            any_min_p = bool((min_p > 0.0).any())
            u = uniforms(seeds, positions)
            packed = to_device(np.stack([temperature, top_p, min_p, top_k, greedy, u]),
                               dev)  # [6, N] float64

        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias is not None
                for t, b in p.logit_bias.items()]
        bias_t = None
        if bias:
            rows, toks, vals = zip(*bias)
            idx = to_device(np.array([rows, toks], dtype=np.int64), dev)  # [2, B]
            bias_t = (idx[0], idx[1], to_device(np.array(vals, dtype=np.float32), dev))
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplingBatch(
            num_rows=n, vocab_size=v, params=packed,
            all_greedy=all_greedy, any_greedy=bool(greedy.any()), any_min_p=any_min_p,
            sort_rows_host=sort_rows, num_candidates=k_max,
            top_k_rows_host=top_k_rows, top_k_candidates=k_max_topk,
            top_p_rows_host=top_p_rows, device=dev,
            bias_rows=bias_t[0] if bias_t else None, bias_tokens=bias_t[1] if bias_t else None,
            bias_values=bias_t[2] if bias_t else None,
            logprob_rows=lp_rows, logprob_counts=[params[i].logprobs for i in lp_rows],
            logprob_index=(to_device(np.array(lp_rows, dtype=np.int64), dev)
                           if lp_rows else None))

