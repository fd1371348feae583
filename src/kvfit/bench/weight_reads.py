"""The weight bytes one forward step reads, for the benchmarks' rooflines: not every parameter
byte. A mixture-of-experts layer reads only the routed experts its tokens chose (at one token,
``top_k`` of ``E``), and an embedding table that is not also the LM head is read a row a token.
Counting every parameter (as ``ModelRunner.weight_bytes`` does, rightly, for memory) put
DeepSeek-V2-Lite's batch-1 decode at "143% of the roofline" (docs/benchmarks.md).

``weight_reads(model)`` walks the model once; ``bytes_read(reads, tokens)`` prices a step of
``tokens`` tokens. Beyond one token the experts a step reads depend on the routing; the price
takes the expected number of distinct experts under uniform independent routing,
``E (1 - (1 - k / E) ^ T)`` (exact at T = 1, ``E`` for large T). Owns nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class WeightReads:
    """Bytes of the weights by how a step reads them."""

    total: int  # every parameter byte (what the GPU holds)
    routed: tuple[tuple[int, int, int], ...]  # per MoE layer: (its routed experts' bytes, E, k)
    embed_table: int  # bytes of input-embedding tables that are not also the LM head
    embed_row: int  # bytes of one row of those tables


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def weight_reads(model: nn.Module) -> WeightReads:
    """The model's parameter bytes split by how a forward step reads them: routed experts
    (modules with ``experts``, ``num_experts`` and ``top_k``), input embeddings whose table is
    not the LM head (the model's ``lm_head`` has its own weight), the rest."""
    total = _bytes(model.parameters())  # a tied parameter once (parameters() deduplicates)
    routed = []
    for m in model.modules():
        if all(hasattr(m, a) for a in ("experts", "num_experts", "top_k")) and m.num_experts:
            routed.append((_bytes(m.experts.parameters()), int(m.num_experts), int(m.top_k)))
    table = row = 0
    for m in model.modules():
        if isinstance(m, nn.Embedding) and not _used_as_head(model, m.weight):
            table += _bytes([m.weight])
            row += m.weight.shape[1] * m.weight.element_size()
    return WeightReads(total, tuple(routed), table, row)


def _used_as_head(model: nn.Module, weight) -> bool:
    # a model whose LM head is its embedding table (no lm_head module: the forward multiplies by
    # the table) reads the whole table each step
    head = getattr(model, "lm_head", None)
    if head is None:
        return True
    return getattr(head, "weight", None) is weight


def bytes_read(reads: WeightReads | dict, tokens: int) -> float:
    """The weight bytes a forward step of ``tokens`` tokens reads (see the module's note);
    ``reads`` as ``weight_reads`` returns it or as its ``dataclasses.asdict`` (a benchmark's
    JSON)."""
    if isinstance(reads, dict):
        reads = WeightReads(reads["total"], tuple(map(tuple, reads["routed"])),
                            reads["embed_table"], reads["embed_row"])
    t = max(int(tokens), 1)
    skipped = 0.0
    for b, e, k in reads.routed:
        distinct = e * (1.0 - (1.0 - k / e) ** t)
        skipped += b * (1.0 - distinct / e)
    return reads.total - skipped - reads.embed_table + t * reads.embed_row
