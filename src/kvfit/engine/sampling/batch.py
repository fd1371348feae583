"""SamplingBatch: the per-row sampling parameters of one step, as device tensors built once.

Built on the host from the requests that sample this step (one list pass, no device work but one
packed host-to-device copy); read by ``sample``. Host-side flags (all greedy, which rows need the
sorted candidates, how many candidates, which rows want logprobs) let the sampler skip work
without ever asking the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvfit.engine.sampling.randomness import split_seeds, uniforms
from kvfit.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Row i describes the request whose logits are row i of the step's sample logits."""

    num_rows: int
    vocab_size: int
    # device tensors, [N] each
    greedy: torch.Tensor  # bool: temperature 0 (argmax)
    temperature: torch.Tensor  # float32, 1.0 on greedy rows
    top_k: torch.Tensor  # int64 in [1, V]; V when off
    top_p: torch.Tensor  # float32 in (0, 1]; 1 when off
    min_p: torch.Tensor  # float32 in [0, 1]; 0 when off
    uniform: torch.Tensor  # float64 in (0, 1): the row's draw, a function of (seed, position)
    # host-side decisions (no device sync needed to make them)
    all_greedy: bool
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

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              vocab_size: int, device: torch.device | str) -> "SamplingBatch":
        """params/seeds/positions per row: the request's parameters, its 64-bit sampling seed and
        the position (index in prompt + output) of the token being sampled."""
        n, v = len(params), vocab_size
        greedy = [p.greedy for p in params]
        top_k = [v if g or p.top_k in (-1, 0) else min(p.top_k, v) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        temp = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        sort_rows = [i for i in range(n) if top_k[i] < v or top_p[i] < 1.0]
        need_full = any(top_k[i] == v for i in sort_rows)  # top-p without top-k sees every token
        k_max = v if need_full else max((top_k[i] for i in sort_rows), default=0)

        u = uniforms(split_seeds(seeds), torch.tensor(list(positions), dtype=torch.int64))
        packed = torch.stack([torch.tensor(temp, dtype=torch.float64),
                              torch.tensor(top_p, dtype=torch.float64),
                              torch.tensor(min_p, dtype=torch.float64),
                              torch.tensor(top_k, dtype=torch.float64),
                              torch.tensor(greedy, dtype=torch.float64), u])  # [6, N]
        dev = torch.device(device)
        if dev.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(dev, non_blocking=True)

        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
                for t, b in p.logit_bias.items()]
        bias_t = None
        if bias:
            rows, toks, vals = zip(*bias)
            bias_t = (torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True),
                      torch.tensor(toks, dtype=torch.int64).to(dev, non_blocking=True),
                      torch.tensor(vals, dtype=torch.float32).to(dev, non_blocking=True))
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplingBatch(
            num_rows=n, vocab_size=v,
            greedy=packed[4] > 0.5, temperature=packed[0].float(), top_k=packed[3].long(),
            top_p=packed[1].float(), min_p=packed[2].float(), uniform=packed[5],
            all_greedy=all(greedy), any_min_p=any(m > 0.0 for m in min_p),
            sort_rows=(torch.tensor(sort_rows, dtype=torch.int64).to(dev, non_blocking=True)
                       if sort_rows else None),
            num_candidates=k_max,
            bias_rows=bias_t[0] if bias_t else None, bias_tokens=bias_t[1] if bias_t else None,
            bias_values=bias_t[2] if bias_t else None,
            logprob_rows=lp_rows, logprob_counts=[params[i].logprobs for i in lp_rows])
