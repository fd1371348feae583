"""Paged prefill/extend attention (Triton): causal over a cached prefix, mixed batches, GQA-packed.

A step's flat batch holds B requests; request i has q_len_i new tokens at absolute positions
``kv_len_i - q_len_i ..``, and its kv_len_i cached tokens (this step's included) live in pages.
Rows of a program are (token, query head of the group) pairs, row r -> token r // G, head r % G,
so one program per KV head loads each KV tile once for all G query heads sharing it. Decode
tokens of a mixed batch are simply requests with q_len 1.

The host-side ``order_prefill_blocks`` lists (request, first row) per program once per step,
heaviest block first; the kernel reads q offsets and lengths from ``cu_seqlens_q`` and
``kv_lens`` on the device. A block's KV tiles split into three runs: tiles that may cross the
sliding window's lower edge, tiles wholly visible to every row (no masks on loads or logits),
and tiles that cross the causal diagonal or the end of the cache; only the first and last runs
pay for masks.
Owns nothing; writes ``out``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np
import torch

from kvfit.kernels.hadamard import fwht_scale
from kvfit.kernels.interpret import expose_for_interpreter
from kvfit.transfer import to_device

LOG2E = 1.4426950408889634


@functools.cache
def build():
    """The jitted prefill kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.tile_math import build as build_tile_math

    from kvfit.kernels.hadamard import build as build_hadamard

    shared = build_tile_math()
    tile_logits, softmax_pv, request_span = (shared.tile_logits, shared.softmax_pv,
                                             shared.request_span)
    fwht_rows = build_hadamard()
    from kvfit.kernels.row_quant import build as build_row_quant

    i8_to_f16 = build_row_quant().i8_to_f16

    @triton.jit
    def _to_q_dtype(x, q, I8_ASM: tl.constexpr):
        # a KV tile -> the MMA dtype (q's); int8 tiles four values per inline asm when I8_ASM
        # (no I2F, a quarter-rate unit: 2x the fp8 tile's instructions per KV element)
        tl.static_assert(len(x.shape) == 2)  # (also keeps ``tl`` in this function's closure)
        if I8_ASM:
            y = i8_to_f16(x)
        else:
            y = x.to(q.dtype)
        return y

    @triton.jit
    def _tile(acc, m_i, l_i, q, n0, hi, qpos, KC, VC, KS, VS, bt_row, head_off, s_head,
              stride_cp, stride_sp, qk_scale, softcap, qb, window,
              D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
              ROWS: tl.constexpr, MASKED: tl.constexpr, I8_ASM: tl.constexpr):
        # One KV tile [n0, n0 + BLOCK_N) into the online softmax of the block's rows. Unmasked
        # tiles (MASKED False) lie wholly below every row's causal diagonal and inside its
        # window, and below hi: no masks on loads or logits.
        n = n0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        nmask = n < hi
        ks = qk_scale  # int8 (ROWS): the tokens' scales, 0 for dead tokens
        vs = qk_scale
        if V_T:
            # V pages token-minor [H, D, P]: addresses per page slice, loads masked per page
            # (16-byte vectors), dead tokens of a live page zeroed after the load
            PP: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
            NP: tl.constexpr = BLOCK_N // PP
            first = n0 + tl.arange(0, NP) * PP
            tp = tl.multiple_of(n0 % PAGE, PP) + tl.arange(0, PP)
            if MASKED:
                pmask = first < hi
                pg = tl.load(bt_row + first // PAGE, mask=pmask, other=0).to(tl.int64)
            else:
                pg = tl.load(bt_row + first // PAGE).to(tl.int64)
            base = pg * stride_cp + head_off  # [NP]
            kptr = KC + base[:, None, None] + (tp * D)[None, :, None] + d[None, None, :]
            vptr = VC + base[None, :, None] + (d * PAGE)[:, None, None] + tp[None, None, :]
            if MASKED:
                k = tl.load(kptr, mask=pmask[:, None, None], other=0.0)
                vt = tl.load(vptr, mask=pmask[None, :, None], other=0.0)
            else:
                k = tl.load(kptr)
                vt = tl.load(vptr)
            if ROWS:
                sptr = (pg * stride_sp + s_head)[:, None] + tp[None, :]  # [NP, PP]
                if MASKED:
                    smask = (first[:, None] + tl.arange(0, PP)[None, :]) < hi
                    ks = tl.load(KS + sptr, mask=smask, other=0.0)
                    vs = tl.load(VS + sptr, mask=smask, other=0.0)
                else:
                    ks = tl.load(KS + sptr)
                    vs = tl.load(VS + sptr)
                ks = tl.reshape(ks, (BLOCK_N,)).to(tl.float32)
                vs = tl.reshape(vs, (BLOCK_N,)).to(tl.float32)
            k = _to_q_dtype(tl.reshape(k, (BLOCK_N, D)), q, I8_ASM)  # [NP, PP, D] -> [BLOCK_N, D]
            # [D, NP, PP] -> [D, BLOCK_N] -> [BLOCK_N, D]
            v = _to_q_dtype(tl.trans(tl.reshape(vt, (D, BLOCK_N))), q, I8_ASM)
            if MASKED or PP < 8:
                # (PP < 8: the select also keeps Triton 3.6 from folding a 16-bit V tile's
                # reshape+transpose into a shared-memory layout it cannot build)
                v = tl.where(nmask[:, None], v, 0.0)
        else:
            if MASKED:
                page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row + n // PAGE).to(tl.int64)
            off = page * stride_cp + head_off + (n % PAGE) * D  # [BLOCK_N]
            if MASKED:
                k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
                v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            else:
                k = tl.load(KC + off[:, None] + d[None, :])
                v = tl.load(VC + off[:, None] + d[None, :])
            if ROWS:
                soff = page * stride_sp + s_head + n % PAGE
                if MASKED:
                    ks = tl.load(KS + soff, mask=nmask, other=0.0).to(tl.float32)
                    vs = tl.load(VS + soff, mask=nmask, other=0.0).to(tl.float32)
                else:
                    ks = tl.load(KS + soff).to(tl.float32)
                    vs = tl.load(VS + soff).to(tl.float32)
            k = _to_q_dtype(k, q, I8_ASM)
            v = _to_q_dtype(v, q, I8_ASM)
        qk = tile_logits(q, k, ks, qb, 0.0, qk_scale, softcap, HAS_SOFTCAP, ROWS, PREC)  # [M, N]
        vis = n[None, :] <= qpos[:, None]  # read only when MASKED
        if MASKED:
            vis = vis & nmask[None, :]
            if HAS_WINDOW:
                vis = vis & (n[None, :] > qpos[:, None] - window)
        return softmax_pv(qk, v, vs, acc, m_i, l_i, vis, MASKED, ROWS, PREC, False)

    @triton.jit
    def _prefill(Q, KC, VC, KS, VS, QB, BT, CU, KVLEN, BLK, OUT,
                 qk_scale, softcap, window, v_scale,
                 stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_cp, stride_ch, stride_sp, stride_sh, stride_bt, stride_qb,
                 G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HKV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
                 F16: tl.constexpr, ROWS: tl.constexpr, HAS_QBIAS: tl.constexpr,
                 ROTATE_Q: tl.constexpr = False, LOG2D: tl.constexpr = 0,
                 HSCALE: tl.constexpr = 1.0, I8_ASM: tl.constexpr = False):
        # one program per (listed block, KV head); heads vary fastest so the heaviest blocks
        # (listed first by order_prefill_blocks) start first on every head
        pid = tl.program_id(0)
        blk = pid // HKV
        h = pid % HKV
        req = tl.load(BLK + 2 * blk)
        row0 = tl.load(BLK + 2 * blk + 1)
        q_start, q_len, prefix = request_span(CU, KVLEN, req)
        r = row0 + tl.arange(0, BLOCK_M)
        tok = r // G
        hq = h * G + r % G
        rmask = tok < q_len
        qpos = prefix + tok  # [BLOCK_M]
        d = tl.arange(0, D)
        q = tl.load(Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + hq[:, None] * stride_qh
                    + d[None, :], mask=rmask[:, None], other=0.0)
        if ROTATE_Q:  # the KV transform's rotation of q (q @ H, butterflies in float32)
            qr = fwht_rows(q, BLOCK_M, D, LOG2D, HSCALE)
            if F16:
                q = qr.to(tl.float16)
            else:
                q = qr.to(q.dtype)
        if F16:  # 8-bit pages: float16 MMAs (int8 -> f16 is exact; one packed cvt per two fp8
            # values, where bf16 needs two)
            q = q.to(tl.float16)
        qb = 0.0  # q . k_mean per row, added before the softcap (centered K caches)
        if HAS_QBIAS:
            qb = tl.load(QB + (q_start + tok).to(tl.int64) * stride_qb + hq, mask=rmask,
                         other=0.0)[:, None]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        first_tok = row0 // G
        last_tok = tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)
        hi = prefix + last_tok + 1
        lo = 0
        if HAS_WINDOW:
            # tiles start at a multiple of BLOCK_N below the first row's window edge (the
            # tokens below the edge are masked in the first run): aligned tile addresses, which
            # token-minor V pages need, and which keep the HND tiles' loads as fast as without
            # a window (16-bit, 256-d, 1k prompts: 1.16x the full layer's time when unaligned)
            lo = tl.maximum(0, prefix + first_tok - window + 1) // BLOCK_N * BLOCK_N
        # tiles [0, t_win) may cross the window's lower edge, [t_win, t_diag) are wholly visible
        # to every row, [t_diag, n_tiles) cross the causal diagonal or hi: masks only where needed
        n_tiles = tl.cdiv(hi - lo, BLOCK_N)
        t_diag = tl.minimum((prefix + first_tok + 1 - lo) // BLOCK_N, n_tiles)
        t_win = 0
        if HAS_WINDOW:
            t_win = tl.minimum(tl.cdiv(tl.maximum(prefix + last_tok - window + 1 - lo, 0),
                                       BLOCK_N), n_tiles)
            t_diag = tl.maximum(t_diag, t_win)
        bt_row = BT + req.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        s_head = h * stride_sh
        for t in range(0, t_win):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, lo + t * BLOCK_N, hi, qpos, KC, VC, KS, VS,
                                  bt_row, head_off, s_head, stride_cp, stride_sp, qk_scale,
                                  softcap, qb, window, D, PAGE, BLOCK_N, V_T, HAS_SOFTCAP,
                                  HAS_WINDOW, PREC, ROWS, True, I8_ASM)
        for t in range(t_win, t_diag):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, lo + t * BLOCK_N, hi, qpos, KC, VC, KS, VS,
                                  bt_row, head_off, s_head, stride_cp, stride_sp, qk_scale,
                                  softcap, qb, window, D, PAGE, BLOCK_N, V_T, HAS_SOFTCAP,
                                  HAS_WINDOW, PREC, ROWS, False, I8_ASM)
        for t in range(t_diag, n_tiles):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, lo + t * BLOCK_N, hi, qpos, KC, VC, KS, VS,
                                  bt_row, head_off, s_head, stride_cp, stride_sp, qk_scale,
                                  softcap, qb, window, D, PAGE, BLOCK_N, V_T, HAS_SOFTCAP,
                                  HAS_WINDOW, PREC, ROWS, True, I8_ASM)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None] * v_scale
        tl.store(OUT + (q_start + tok).to(tl.int64)[:, None] * stride_ot + hq[:, None] * stride_oh
                 + d[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])

    expose_for_interpreter(globals(), locals())
    return _prefill


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel: rows (token x head pairs) and KV tokens per tile,
    warps, software-pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # int8 tiles -> float16 by inline asm (four per prmt/sub block) or "cast" (Triton's I2F)
    i8_cvt: str = "asm"


def prefill_config(head_dim: int, q_dtype: torch.dtype,
                   cache_dtype: torch.dtype | None = None) -> PrefillConfig:
    """Measured on the H200 against FlashInfer fa2 (docs/kernels.md, explore_prefill.py).

    5 stages are the fewest at which Triton overlaps the block-table tile loads with the MMAs
    (below that, each tile's loads are waited for right after they are issued). 128-d heads:
    16-bit pages 128 rows x 8 warps (0.83-1.15x FlashInfer's time at 16k-1k prompts), fp8 pages
    64 rows x 4 warps (0.91-1.13x). 64-d heads: 64 rows, 4 warps, 2 stages (0.45-0.75x). Heads
    over 128 keep 32-token tiles and 2 stages (shared memory)."""
    if q_dtype == torch.float32 or cache_dtype == torch.float32:  # exact float32 products
        return PrefillConfig(16, 16, 4, 1)
    if head_dim > 128:
        return PrefillConfig(64, 32, 4, 2)
    if head_dim <= 64:
        return PrefillConfig(64, 64, 4, 2)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        return PrefillConfig(64, 64, 4, 5)
    return PrefillConfig(128, 64, 8, 5)


def order_prefill_blocks(q_lens: Sequence[int], group: int, block_m: int, device,
                kv_lens: Sequence[int] | None = None) -> torch.Tensor:
    """[NB, 2] int32 (request, first row) for every program of a step (host work, one copy).

    Blocks are listed heaviest first (most KV tokens under their last row; ``kv_lens`` default
    to ``q_lens``, no cached prefix), so the long causal blocks start in the first wave and the
    short ones fill the tail."""
    work: list[tuple[int, int, int]] = []
    for i, ql in enumerate(q_lens):
        prefix = (kv_lens[i] if kv_lens is not None else ql) - ql
        rows = ql * group
        for r0 in range(0, rows, block_m):
            last = min((r0 + block_m - 1) // group, ql - 1)
            work.append((prefix + last, i, r0))
    work.sort(key=lambda w: -w[0])
    flat = [x for _, i, r0 in work for x in (i, r0)]
    # pinned: a pageable copy would wait for the GPU's earlier work (kvfit.transfer)
    return to_device(np.asarray(flat, dtype=np.int32).reshape(-1, 2), torch.device(device))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                  blocks: torch.Tensor, cfg: PrefillConfig, out: torch.Tensor, sm_scale: float,
                  k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None,
                  window: int | None = None, v_t: bool = False,
                  k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None,
                  q_bias: torch.Tensor | None = None, rotate_q: bool = False) -> torch.Tensor:
    """q ``[T, Hq, D]`` -> ``out [T, Hq, D]`` (written) for the programs listed in ``blocks``
    (``order_prefill_blocks`` with ``cfg.block_m`` rows).

    K pages ``[pages, Hkv, P, D]``; V the same, or token-minor ``[pages, Hkv, D, P]`` if ``v_t``.
    int8 pages need ``k_scale_cache``/``v_scale_cache`` (float16 ``[pages, Hkv, P]``), which
    replace ``k_scale``/``v_scale``: logits of key j times its K scale, P's column j times its V
    scale before P@V. ``q_bias`` ``[T, Hq]`` float32 (q . k_mean of a centered K cache) is
    added back to every logit before the soft-cap. ``rotate_q``: the kernel attends with
    ``q @ H`` (the KV transform's Hadamard rotation, applied to each q row in registers; D a
    power of two), for pages whose keys were stored rotated (``store_kv_chunks(rotate=True)``)."""
    from kvfit.kernels.decode import EIGHT_BIT, _checked_bias, scale_cache_args

    kern = build()
    nb = blocks.shape[0]
    if nb == 0:
        return out
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    if cfg.i8_cvt not in ("asm", "cast"):
        raise ValueError(f"PrefillConfig.i8_cvt must be 'asm' or 'cast', got {cfg.i8_cvt!r}")
    if rotate_q and d & (d - 1):
        raise ValueError(f"paged_prefill(rotate_q=True) needs a power-of-two head_dim, got {d}")
    fp32 = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    rows = k_cache.dtype == torch.int8
    ks, vs, ssp, ssh = scale_cache_args(
        k_cache, None if k_scale_cache is None else (k_scale_cache, v_scale_cache))
    if rows:
        k_scale = v_scale = 1.0
    qb = _checked_bias(q_bias, q, k_scale, softcap)
    kern[(nb * hkv,)](
        q, k_cache, v_cache, ks, vs, q if qb is None else qb, block_table, cu_seqlens_q,
        kv_lens, blocks, out,
        float(sm_scale * k_scale * LOG2E), float(softcap or 0.0), int(window or 0), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), ssp, ssh, block_table.stride(0),
        0 if qb is None else qb.stride(0), G=hq // hkv, D=d, PAGE=k_cache.shape[2], HKV=hkv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, V_T=v_t, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None, PREC="ieee" if fp32 else "tf32",
        F16=k_cache.dtype in EIGHT_BIT and not fp32, ROWS=rows, HAS_QBIAS=qb is not None,
        ROTATE_Q=bool(rotate_q), LOG2D=d.bit_length() - 1,
        I8_ASM=rows and not fp32 and cfg.i8_cvt == "asm",
        HSCALE=fwht_scale(d) if rotate_q else 1.0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
