"""How a model splits over ``size`` tensor-parallel ranks (pure arithmetic, no tensors).

* Query heads: ``num_heads / size`` consecutive heads per rank (``size`` must divide them).
* KV heads: ``num_kv_heads / size`` per rank when there are at least as many KV heads as ranks
  (``size`` must divide them); otherwise each rank keeps the one KV head its query heads read,
  replicated on ``size / num_kv_heads`` ranks (``num_kv_heads`` must divide ``size``). Either
  way rank r's query heads [r*Hq/N, (r+1)*Hq/N) read exactly its KV heads (grouped-query
  attention groups never straddle ranks).
* MLP: ``intermediate_size / size`` gate/up rows and down_proj columns per rank (MoE: the same
  for every routed and shared expert).
* MLA (DeepSeek-V2): query heads split as above; the latent (one slab per token, read by every
  head) is computed and cached whole on every rank.
* Vocabulary: ``ceil(vocab / size)`` embedding / LM-head rows per rank; the last rank's tail is
  padding (zero rows whose logits are cut off after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """Rank's query heads [q_start, q_start + q_count) and KV heads [kv_start, kv_start +
    kv_count) of the checkpoint."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank keeps (and stores in its pool)."""
    return num_kv_heads // size if num_kv_heads >= size else 1


def kv_replication(num_kv_heads: int, size: int) -> int:
    """Ranks holding each KV head (1 when the KV heads split)."""
    return 1 if num_kv_heads >= size else size // num_kv_heads


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    q = num_heads // size
    kv = local_kv_heads(num_kv_heads, size)
    kv_start = rank * kv if num_kv_heads >= size else rank // kv_replication(num_kv_heads, size)
    return HeadShard(rank * q, q, kv_start, kv)


def even_shard(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's equal part of ``total`` (``size`` divides it)."""
    n = total // size
    return rank * n, n


@dataclass(frozen=True)
class VocabShard:
    """Rank's vocabulary rows [start, start + count) of the checkpoint; ``padded`` rows held."""

    start: int
    count: int
    padded: int


def shard_vocab(vocab: int, rank: int, size: int) -> VocabShard:
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    return VocabShard(start, max(0, min(vocab, start + per) - start), per)


def head_refusals(num_heads: int, num_kv_heads: int, size: int) -> list[str]:
    """Why the query/KV heads cannot split over ``size`` ranks (empty when they can)."""
    out = []
    if size > num_heads:
        out.append(f"{size} ranks is more than the model's {num_heads} query heads")
    elif num_heads % size:
        out.append(f"{size} ranks does not divide the model's {num_heads} query heads")
    if num_kv_heads >= size and num_kv_heads % size:
        out.append(f"{size} ranks does not divide the model's {num_kv_heads} KV heads")
    if num_kv_heads < size and size % num_kv_heads:
        out.append(f"the model's {num_kv_heads} KV heads do not divide {size} ranks (each KV "
                   f"head must be replicated on the same number of ranks)")
    return out


def divide_refusals(size: int, parts: dict[str, int]) -> list[str]:
    """``parts`` = {"the MLP's intermediate size": 14336, ...}: one reason per part that
    ``size`` ranks do not divide."""
    return [f"{size} ranks does not divide {what} {n}" for what, n in parts.items() if n % size]


def tp_refusals(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> list[str]:
    """Why a Llama-family model of these shapes cannot split over ``size`` ranks (empty when
    it can)."""
    if size == 1:
        return []
    return (head_refusals(num_heads, num_kv_heads, size)
            + divide_refusals(size, {"the MLP's intermediate size": intermediate_size}))
