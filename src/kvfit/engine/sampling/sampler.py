"""The batched sampler: next-token ids for a whole step in a few whole-batch tensor ops.

Order of operations on a logits row (float32):
1. the structured-output bitmask: disallowed tokens become -inf (greedy rows too);
2. ``logit_bias`` is added (so a +100 bias forces a token and -100 bans it, greedy rows too);
3. greedy rows (temperature 0) take the argmax; the other rows are divided by their temperature,
   then filtered: top-k (the k largest), min-p (probability >= min_p x the largest), top-p (the
   smallest prefix, in descending order, whose mass reaches top_p of what top-k and min-p left).
   Every filter is a cutoff on the row's values, so ties at a cutoff are kept and the kept set
   does not depend on how ties are ordered;
4. one token is drawn by inverting the CDF (float64, token-id order, computed in two levels:
   128-token block sums, then inside the chosen block) of the softmax over the kept tokens at the
   row's uniform ``u`` (see ``randomness``).

Cost (the torch ops: the CPU path and the reference): argmax, one softmax and one block-sum pass
over [N, V], plus a sort restricted to the rows that use top-k or top-p: ``topk`` of the largest
top-k when every such row sets top-k, a full sort only when a row uses top-p without top-k. On
CUDA the draw runs in kernels/sampling.py (two or three launches; top-p without top-k by pivots,
no sort) with the same semantics. No per-row Python loop and no host sync: the chosen ids come
back as a device tensor; the caller copies them once.

Logprobs (vLLM semantics) are computed only for rows that ask: log_softmax of the raw logits
(before the mask, bias, temperature and filters), the chosen token's and the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvfit.engine.sampling.batch import SamplingBatch

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """token_ids: int64 [N] on the logits' device. For the rows in ``logprob_rows`` (in order):
    chosen_logprobs float32 [M], top_ids int64 [M, n_max] and top_logprobs float32 [M, n_max]."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    logprob_counts: list[int]
    chosen_logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None

    def logprob_dicts(self, token_ids: list[int]) -> dict[int, dict[int, float]]:
        """row -> {chosen: lp, then the row's top-N: lp} (host lists; call after the ids copy)."""
        if not self.logprob_rows:
            return {}
        chosen = self.chosen_logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out = {}
        for j, (row, n) in enumerate(zip(self.logprob_rows, self.logprob_counts)):
            d = {token_ids[row]: chosen[j]}
            for t, v in zip(top_ids[j][:n] if n else (), top_lps[j][:n] if n else ()):
                d.setdefault(t, v)
            out[row] = d
        return out


def unpack_bitmask(token_bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, ceil(V/32)] in xgrammar's layout (bit j of word w: token 32*w + j allowed)
    -> bool [N, V] allowed."""
    n, words = token_bitmask.shape
    if words * 32 < vocab_size:
        raise ValueError(f"token_bitmask has {words} words per row, {vocab_size} logits need "
                         f"{(vocab_size + 31) // 32}")
    shifts = torch.arange(32, device=token_bitmask.device, dtype=torch.int32)
    bits = (token_bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.reshape(n, words * 32)[:, :vocab_size].bool()  # [N, V]


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> a new float32 [N, V] with the tokens the bitmask disallows at -inf."""
    allowed = unpack_bitmask(token_bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.float().masked_fill(~allowed, _NEG_INF)


def processed_logits(logits: torch.Tensor, batch: SamplingBatch,
                     token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [N, V] copy of ``logits`` with the bitmask and logit_bias applied."""
    x = logits.float()
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    elif x is logits and batch.bias_rows is not None:
        x = x.clone()
    if batch.bias_rows is not None:
        x.index_put_((batch.bias_rows, batch.bias_tokens), batch.bias_values, accumulate=True)
    return x


def _cutoffs(x: torch.Tensor, batch: SamplingBatch) -> Optional[torch.Tensor]:
    """x [N, V] temperature-scaled -> float32 [N] per-row cutoff (keep x >= cutoff), or None
    when no row filters."""
    if not batch.any_min_p and batch.sort_rows is None:
        return None
    if batch.any_min_p:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
        cut = x.amax(dim=-1) + torch.log(batch.min_p)  # min_p 0 -> -inf: keeps all
    else:
        cut = torch.full((x.shape[0],), _NEG_INF, device=x.device)
    if batch.sort_rows is None:
        return cut
    rows = batch.sort_rows
    return cut.index_copy(0, rows, _sorted_cutoffs(x.index_select(0, rows), rows,
                                                   batch.num_candidates, batch))


def _sorted_cutoffs(xs: torch.Tensor, rows: torch.Tensor, k: int,
                    batch: SamplingBatch) -> torch.Tensor:
    """xs [S, V]: the temperature-scaled rows ``rows`` -> float32 [S]: the value of the last
    candidate (descending) that top-k, min-p and top-p all keep; ``k`` candidates are sorted
    (at least every row's top-k; V for a row with top-p alone)."""
    if k < xs.shape[-1]:
        vals = torch.topk(xs, k, dim=-1, sorted=True).values  # [S, K] descending
    else:
        vals = torch.sort(xs, dim=-1, descending=True).values  # [S, V]
    top_k = batch.top_k.index_select(0, rows).clamp(max=k)
    kth = vals.gather(1, (top_k - 1).unsqueeze(1))  # [S, 1]
    keep = vals >= kth  # a prefix of vals
    if batch.any_min_p:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p); vals[:, 0] = max
        keep &= vals >= (vals[:, :1] + torch.log(batch.min_p.index_select(0, rows)).unsqueeze(1))
    probs = torch.softmax(vals.masked_fill(~keep, _NEG_INF), dim=-1)  # renormalised over keep
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each candidate
    top_p = batch.top_p.index_select(0, rows)
    top_p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0)).unsqueeze(1)  # 1 = off
    keep &= before < top_p  # still a prefix; position 0 always stays
    last = (keep.sum(dim=-1) - 1).clamp(min=0)
    return vals.gather(1, last.unsqueeze(1)).squeeze(1)


def _draw(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """x [N, V] processed logits -> int64 [N] drawn ids (greedy rows: meaningless, replaced)."""
    x = x / batch.temperature.unsqueeze(1)
    cut = _cutoffs(x, batch)
    if cut is not None:
        x = x.masked_fill(x < cut.unsqueeze(1), _NEG_INF)
    probs = torch.softmax(x, dim=-1)  # NaN only on rows with nothing allowed (replaced later)
    return _inverse_cdf(probs, batch.uniform)


def _draw_fused(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The CUDA path of ``_draw`` (greedy rows and rows with nothing allowed included: they get
    the argmax): kernels/sampling.py, plus ``topk`` in torch for rows that set top-k; rows with
    top-p alone take the pivot kernel when there are at least ``TOP_P_MIN_ROWS`` of them, else
    the torch sort."""
    from kvfit.kernels import sampling

    n_top_p = batch.top_p_rows_host.size
    if 0 < n_top_p < sampling.TOP_P_MIN_ROWS:  # few: sort them with the top-k rows
        top_p_rows, rows, k = None, batch.sort_rows, batch.num_candidates
    else:
        top_p_rows, rows, k = batch.top_p_rows, batch.top_k_rows, batch.top_k_candidates
    cut = None
    if rows is not None:
        xs = x.index_select(0, rows) / batch.temperature.index_select(0, rows).unsqueeze(1)
        cut = torch.full((x.shape[0],), _NEG_INF, device=x.device).index_copy_(
            0, rows, _sorted_cutoffs(xs, rows, k, batch))
    return sampling.draw(x, batch.params, cut, batch.any_min_p, top_p_rows)


# the CUDA draw: kernels/sampling.py (False: the torch ops below, as on the CPU)
FUSED = True

_BLOCK = 128  # tokens per block of the two-level CDF (divides 151,936, 128,256 and 49,152)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs float32 [N, V], u float64 [N] in (0, 1) -> int64 [N]: the first token (id order)
    whose cumulative probability reaches u x total, always a token of positive probability.

    Two levels, so no scan runs over a whole row (a long scan is one thread block per row, slow
    at small N): float64 sums of 128-token blocks, a scan over the blocks picks the block, a scan
    inside that block picks the token.
    """
    n, v = probs.shape
    nb = -(-v // _BLOCK)
    if nb * _BLOCK != v:
        probs = torch.nn.functional.pad(probs, (0, nb * _BLOCK - v))  # zeros: never chosen
    blocks = probs.view(n, nb, _BLOCK)  # [N, nb, B]
    cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # [N, nb]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [N, 1] in (0, total]
    b = torch.searchsorted(cdf, target).clamp_(max=nb - 1)  # [N, 1]: first block reaching it
    before = torch.nn.functional.pad(cdf, (1, 0)).gather(1, b)  # [N, 1] mass before block b
    inner = blocks.gather(1, b.unsqueeze(2).expand(n, 1, _BLOCK)).squeeze(1)  # [N, B]
    inner_cdf = inner.to(torch.float64).cumsum_(dim=-1)  # [N, B]
    # rest > 0; capped at the block's own total (its sum and its scan may round apart)
    rest = torch.minimum(target - before, inner_cdf[:, -1:])
    j = torch.searchsorted(inner_cdf, rest).clamp_(max=_BLOCK - 1)  # [N, 1]
    return (b * _BLOCK + j).squeeze(1).clamp_(max=v - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           token_bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
    """logits [N, V] (any float dtype, row i = batch row i) -> SamplerOutput with the chosen ids
    as a device tensor. ``token_bitmask``: optional int32 [N, ceil(V/32)], xgrammar's packing,
    rows of unconstrained requests all ones (-1). Mutates nothing but what it allocates.

    A row whose every token is disallowed yields the argmax of its processed logits (token 0),
    never NaN or an out-of-range id.
    """
    if logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows, the batch {batch.num_rows}")
    x = processed_logits(logits, batch, token_bitmask)
    if batch.all_greedy:
        ids = x.argmax(dim=-1)
    elif x.is_cuda and FUSED:
        ids = _draw_fused(x, batch)
    else:
        ids = _draw(x, batch)
        # only a bitmask can leave a row with nothing allowed (biases are finite)
        fallback = None if token_bitmask is None else ~torch.isfinite(x.amax(dim=-1))
        if batch.any_greedy and fallback is not None:
            fallback = fallback | batch.greedy
        elif batch.any_greedy:
            fallback = batch.greedy
        if fallback is not None:
            ids = torch.where(fallback, x.argmax(dim=-1), ids)
    out = SamplerOutput(ids, batch.logprob_rows, batch.logprob_counts)
    if batch.logprob_rows:
        rows = batch.logprob_index
        lp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)  # [M, V] raw
        out.chosen_logprobs = lp.gather(1, ids.index_select(0, rows).unsqueeze(1)).squeeze(1)
        n_max = max(batch.logprob_counts)
        if n_max > 0:
            out.top_logprobs, out.top_ids = torch.topk(lp, min(n_max, lp.shape[-1]), dim=-1)
    return out


def top_logprobs(logprobs_row: torch.Tensor, chosen: int, n: int) -> dict[int, float]:
    """{chosen: lp, then the top-n tokens: lp} for one position (prompt logprobs)."""
    d = {chosen: float(logprobs_row[chosen])}
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        for v, t in zip(vals.tolist(), ids.tolist()):
            d.setdefault(t, v)
    return d
