"""SamplingBatch: the per-row sampling parameters of one step, as device tensors built once.

Built on the host from the requests that sample this step (one list pass, no device work but one
packed host-to-device copy); read by ``sample``. Host-side flags (all greedy, which rows need the
sorted candidates, how many candidates, which rows want logprobs) let the sampler skip work
without ever asking the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from kvfit.engine.sampling.randomness import uniforms
from kvfit.sampling_params import SamplingParams
from kvfit.transfer import to_device

_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingBatch:
    """Row i describes the request whose logits are row i of the step's sample logits."""

    num_rows: int
    vocab_size: int
    # device tensors, [N] each; None when every row is greedy
    greedy: Optional[torch.Tensor]  # bool: temperature < 1e-5 (argmax)
    temperature: Optional[torch.Tensor]  # float32, 1.0 on greedy rows
    top_k: Optional[torch.Tensor]  # int64 in [1, V]; V when off
    top_p: Optional[torch.Tensor]  # float32 in (0, 1]; 1 when off
    min_p: Optional[torch.Tensor]  # float32 in [0, 1]; 0 when off
    uniform: Optional[torch.Tensor]  # float64 in (0, 1): the draw, a function of (seed, position)
    # host-side decisions (no device sync needed to make them)
    all_greedy: bool
    any_greedy: bool
    any_min_p: bool
    sort_rows: Optional[torch.Tensor]  # int64 [S] rows needing sorted candidates (top-k/top-p)
    num_candidates: int  # candidates per sort row: max top-k, or V if a row has top-p alone
    # logit_bias as a sparse list of (row, token, bias); None when no row has one
    bias_rows: Optional[torch.Tensor]
    bias_tokens: Optional[torch.Tensor]
    bias_values: Optional[torch.Tensor]
    # rows that asked for logprobs, and how many top alternatives each wants
    logprob_rows: list[int]
    logprob_counts: list[int]
    logprob_index: Optional[torch.Tensor]  # int64 [M] on the device: logprob_rows

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
        temperature = np.where(greedy, 1.0, raw[:, 0])
        top_p = np.where(greedy, 1.0, raw[:, 1])
        min_p = np.where(greedy, 0.0, raw[:, 2])
        top_k = np.where(greedy | (raw[:, 3] <= 0), v, np.minimum(raw[:, 3], v))
        sort_mask = (top_k < v) | (top_p < 1.0)
        sort_rows = np.flatnonzero(sort_mask)
        need_full = bool((sort_mask & (top_k >= v)).any())  # top-p without top-k sees all tokens
        k_max = v if need_full else int(top_k[sort_rows].max(initial=0))
        all_greedy = bool(greedy.all())
        dev = torch.device(device)
        packed = None  # an all-greedy step needs no per-row tensors: argmax only
        if not all_greedy:
            u = uniforms(seeds, positions)
            packed = to_device(torch.from_numpy(
                np.stack([temperature, top_p, min_p, top_k, greedy, u])), dev)  # [6, N] float64

        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias is not None
                for t, b in p.logit_bias.items()]
        bias_t = None
        if bias:
            rows, toks, vals = zip(*bias)
            bias_t = (to_device(torch.tensor(rows, dtype=torch.int64), dev),
                      to_device(torch.tensor(toks, dtype=torch.int64), dev),
                      to_device(torch.tensor(vals, dtype=torch.float32), dev))
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplingBatch(
            num_rows=n, vocab_size=v,
            greedy=None if packed is None else packed[4] > 0.5,
            temperature=None if packed is None else packed[0].float(),
            top_k=None if packed is None else packed[3].long(),
            top_p=None if packed is None else packed[1].float(),
            min_p=None if packed is None else packed[2].float(),
            uniform=None if packed is None else packed[5],
            all_greedy=all_greedy, any_greedy=bool(greedy.any()),
            any_min_p=bool((min_p > 0.0).any()),
            sort_rows=(to_device(torch.from_numpy(sort_rows.astype(np.int64)), dev)
                       if sort_rows.size else None),
            num_candidates=k_max,
            bias_rows=bias_t[0] if bias_t else None, bias_tokens=bias_t[1] if bias_t else None,
            bias_values=bias_t[2] if bias_t else None,
            logprob_rows=lp_rows, logprob_counts=[params[i].logprobs for i in lp_rows],
            logprob_index=(to_device(torch.tensor(lp_rows, dtype=torch.int64), dev)
                           if lp_rows else None))
