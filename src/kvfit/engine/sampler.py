"""Sampler: next tokens from float32 logits, with per-request parameters and RNGs.

Greedy rows take the argmax. Other rows apply temperature, top-k, top-p and min-p, then draw with
the request's own ``torch.Generator`` (so a seeded request gives the same tokens alone or batched,
and across preemption). Before either, each row's ``logit_bias`` is added and the structured-output
``token_bitmask`` (xgrammar's packed int32 ``[N, ceil(V/32)]``, bit set = allowed) sets disallowed
tokens to -inf. Logprobs are those of the model's raw distribution (log_softmax of the logits
before bias, mask and temperature), as vLLM reports them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvfit.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] (float32) -> masked, temperature-scaled logits [V]."""
    x = logits / p.temperature
    if p.top_k not in (-1, 0) and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) >= p.top_p  # keep the token that crosses top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    return x


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V], bitmask int32 [N, ceil(V/32)] (bit j of word w = token 32*w + j allowed)
    -> logits with disallowed tokens at -inf (a new tensor)."""
    n, v = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool()  # [N, W, 32]
    allowed = allowed.reshape(n, -1)[:, :v]  # [N, V]
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` {token id: bias} (ids checked against V by the engine)."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if not rows:
        return logits
    bias = torch.zeros_like(logits)
    bias[rows, cols] = torch.tensor(vals, dtype=logits.dtype).to(logits.device)
    return logits + bias


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           token_bitmask: Optional[torch.Tensor] = None) -> tuple[list[int], torch.Tensor]:
    """logits [N, V] float32 -> (token ids, log_softmax [N, V] of the raw logits).

    ``token_bitmask``: None, or int32 [N, ceil(V/32)] of allowed tokens (greedy rows too)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logits = _apply_logit_bias(logits, params)
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    greedy = logits.argmax(dim=-1)
    out = greedy.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(_filter(logits[i].float(), p), -1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out, logprobs


def top_logprobs(logprobs_row: torch.Tensor, chosen: int, n: int) -> dict[int, float]:
    """{chosen: lp, then the top-n tokens: lp} for one position."""
    d = {chosen: float(logprobs_row[chosen])}
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        for v, t in zip(vals.tolist(), ids.tolist()):
            d.setdefault(t, v)
    return d
