"""Sharded layers. Column-parallel projections need no class: they are ``nn.Linear`` with the
rank's rows (the loader writes the rank's slice, see models/weights.py). The classes here are the
ones whose forward changes: the row-parallel projection (one all-reduce), the
vocabulary-parallel embedding (one all-reduce) and the vocabulary-parallel logits (one gather).
With one rank each is exactly its plain torch counterpart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfit.parallel.layout import shard_vocab
from kvfit.parallel.state import all_gather_last_dim, all_reduce, tp_group


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local @ W_local^T) + b``: the rank holds the input columns of its
    heads / MLP slice; the bias (replicated) is added once, after the sum.

    ``reduce=False``: returns the rank's partial sum (bias on rank 0 only), for a caller that
    adds several partial sums and all-reduces once (a MoE layer: routed + shared experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 reduce: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = tp_group()
        if g.size == 1:
            return F.linear(x, self.weight, self.bias)
        if not self.reduce:
            return F.linear(x, self.weight, self.bias if g.rank == 0 else None)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rank holds vocabulary rows [vocab_start, vocab_start + vocab_count) (padded to the same
    row count on every rank); ids outside them look up zeros and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden: int):
        g = tp_group()
        shard = shard_vocab(vocab_size, g.rank, g.size)
        super().__init__(shard.padded, hidden)
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_count = shard.start, shard.count

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_group().size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_count)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor,
                          vocab_size: int) -> torch.Tensor:
    """float32 logits [N, vocab_size] from the rank's LM-head rows ``weight`` [V_local, H]:
    local matmul, all-gather along the vocabulary, padding rows cut off (every rank gets them)."""
    local = float32_logits(hidden, weight)  # [N, V_local]
    if tp_group().size == 1:
        return local
    return all_gather_last_dim(local)[..., :vocab_size]


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight^T`` as float32 [..., V]. On CUDA with 16-bit operands one cuBLAS product
    writes float32 directly (``out_dtype``): no 16-bit logits written, read back and widened
    (at batch 256 x 151,936 that round trip was a 0.11 ms copy kernel per step on the H200), and
    the logits keep the accumulator's precision."""
    if (_MM_OUT_DTYPE and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == hidden.dtype):
        flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)  # [N, V]
        return out.reshape(*hidden.shape[:-1], weight.shape[0])
    return torch.matmul(hidden, weight.t()).float()


# torch.mm(..., out_dtype=float32) for 16-bit operands: torch >= 2.8 has the overload
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
