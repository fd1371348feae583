"""Split-KV extend: a short prefill/extend step over a long cached context fills the SMs.

A 128-token extend over a 4k cached prefix runs only (128 x G / block_m) x Hkv prefill programs
(32 for Qwen3-1.7B), each walking all 66 key tiles: latency bound on 132 SMs. With a split the
prefill kernel (``kernels/prefill.py``) runs each block's keys in up to ``num_splits`` programs
of at least ``min_tiles`` tiles each, writes partial rows and their base-2 log-sum-exps, and
``merge`` combines them per block (one launch, only blocks of more than one split).

Prefill CUDA graphs (engine/prefill_graph.py) split in buckets of up to ``SPLIT_MAX_TOKENS``
tokens; eager steps only with ``EAGER_SPLIT`` (off: they are bound by their launches on the
host), up to the same size. The partition of a block's
tiles depends only on the block (its rows' context), never on the grid or the batch: a padded
graph step and the eager step with ``EAGER_SPLIT`` give the same bits, and a block whose
context is at most ``min_tiles`` tiles is computed exactly as without a split.
``ExtendSplit`` owns the float32 scratch (partial rows ``[splits, T, Hq, D]``, LSEs
``[splits, T, Hq]``), reserved once for CUDA graphs and grown on demand in eager steps.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kvfit.kernels.interpret import expose_for_interpreter

# steps (graph buckets, and eager steps with EAGER_SPLIT) of at most this many tokens split
# their keys; larger steps have programs enough
SPLIT_MAX_TOKENS = 512
NUM_SPLITS = 8  # programs per block at most (a fixed grid dimension)
# key tiles per split at least (512 tokens of 64-token tiles). H200, Qwen3-1.7B fp8, the cached
# probe's 128-token extend over 4,224 keys in a graph: at 16, 5 splits of up to 16 tiles took
# 40 us per layer (+ 7 us merge), ~2.5 us per tile and program (latency bound); at 8 every
# block runs 8 splits of 9 tiles, one wave of 256 programs (two fit an SM).
MIN_TILES = 8
# eager steps split too: off. An eager short step is bound by its launches on the host (a
# 128-token extend: 16 ms of launches for ~3 ms of GPU work), so splitting gains nothing
# there, and on the H200 the eager probe with splits measured slower (34 ms against 17 ms
# TTFT, not explained yet). Tests turn it on to compare a graph step with the eager one bit
# for bit.
EAGER_SPLIT = False


@functools.cache
def build():
    """The jitted merge kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # the Triton interpreter looks them up there
    from kvfit.kernels.tile_math import build as build_tile_math

    request_span = build_tile_math().request_span

    @triton.jit
    def _merge(OP, LSE, CU, KVLEN, BLK, OUT, v_scale, stride_ot, stride_oh, stride_ps,
               G: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TILES,
               ROWS: tl.constexpr):
        # one program per (listed block, KV head, ROWS of the block's BLOCK_M rows), blocks
        # as in the prefill kernel; blocks of one split (written by the prefill kernel
        # itself) and spare blocks exit
        pid = tl.program_id(0)
        blk = pid // HKV
        h = pid % HKV
        part = tl.program_id(1)
        req = tl.load(BLK + 2 * blk)
        if req < 0:
            return
        row0 = tl.load(BLK + 2 * blk + 1)
        q_start, q_len, prefix = request_span(CU, KVLEN, req)
        last_tok = tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)
        n_tiles = tl.cdiv(prefix + last_tok + 1, BLOCK_N)
        per = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), SPLIT_TILES)
        ns = tl.cdiv(n_tiles, per)
        if ns <= 1:
            return
        r = row0 + part * ROWS + tl.arange(0, ROWS)
        tok = r // G
        hq = h * G + r % G
        rmask = tok < q_len
        d = tl.arange(0, D)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for s in range(0, ns):
            prow = (s * stride_ps + (q_start + tok) * (HKV * G) + hq).to(tl.int64)  # [ROWS]
            lse = tl.load(LSE + prow, mask=rmask, other=0.0)
            o = tl.load(OP + prow[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
            m_new = tl.maximum(m, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            w = tl.exp2(lse - m_use)
            acc = acc * alpha[:, None] + w[:, None] * o
            den = den * alpha + w
            m = m_new
        safe = tl.where(den > 0, den, 1.0)
        out = acc / safe[:, None] * v_scale
        tl.store(OUT + (q_start + tok).to(tl.int64)[:, None] * stride_ot
                 + hq[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=rmask[:, None])

    expose_for_interpreter(globals(), locals())
    return _merge


def wants_split(num_tokens: int, max_kv_len: int, block_n: int,
                min_tiles: int = MIN_TILES) -> bool:
    """Whether an eager prefill step of ``num_tokens`` tokens whose longest request holds
    ``max_kv_len`` tokens splits the keys of its full layers (graph buckets of up to
    ``SPLIT_MAX_TOKENS`` tokens always do): only with ``EAGER_SPLIT``, only such short steps, and
    only when some block can have more than one split (else the split kernel computes the
    same bits as the plain one, without the merge launch)."""
    return (EAGER_SPLIT and num_tokens <= SPLIT_MAX_TOKENS
            and max_kv_len > min_tiles * block_n)


class ExtendSplit:
    """Owns the split scratch of one backend (float32, reused by every layer and step; CUDA
    graphs capture its addresses, so ``reserve`` sizes it before any capture)."""

    num_splits = NUM_SPLITS
    min_tiles = MIN_TILES

    def __init__(self):
        self._op: Optional[torch.Tensor] = None
        self._lse: Optional[torch.Tensor] = None
        self.frozen = False  # True once graphs hold its addresses: never reallocated then

    def reserve(self, num_tokens: int, num_q_heads: int, head_dim: int, device) -> None:
        """Allocate scratch for steps of up to ``num_tokens`` tokens (mutates self)."""
        rows = self.num_splits * num_tokens * num_q_heads
        if self._lse is None or self._lse.shape[0] < rows or self._op.shape[1] != head_dim:
            if self.frozen:
                raise RuntimeError("the split scratch is captured in CUDA graphs: reserve it "
                                   "for the largest bucket before capturing")
            self._op = torch.empty((rows, head_dim), dtype=torch.float32, device=device)
            self._lse = torch.empty((rows,), dtype=torch.float32, device=device)

    def scratch(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial rows ``[splits * T * Hq, D]`` and LSEs ``[splits * T * Hq]`` for q
        ``[T, Hq, D]`` (grown if needed, outside graphs)."""
        t, hq, d = q.shape
        self.reserve(t, hq, d, q.device)
        return self._op, self._lse

    def merge(self, op, lse, cu_seqlens_q, kv_lens, blocks, out, cfg, hkv: int,
              v_scale: float) -> None:
        """Combine the partial rows of blocks of more than one split into ``out`` (written)."""
        t, hq, d = out.shape
        rows = min(16, cfg.block_m)  # 4-8 programs per block: the merge is latency bound too
        build()[(blocks.shape[0] * hkv, cfg.block_m // rows)](
            op, lse, cu_seqlens_q, kv_lens, blocks, out, v_scale, out.stride(0), out.stride(1),
            t * hq, G=hq // hkv, D=d, HKV=hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            NUM_SPLITS=self.num_splits, SPLIT_TILES=self.min_tiles, ROWS=rows, num_warps=4)
