"""Paged prefill/extend attention (Triton): causal over a cached prefix, mixed batches, GQA-packed.

A step's flat batch holds B requests; request i has q_len_i new tokens at absolute positions
``kv_len_i - q_len_i ..``, and its kv_len_i cached tokens (this step's included) live in pages.
Rows of a program are (token, query head of the group) pairs, row r -> token r // G, head r % G,
so one program per KV head loads each KV tile once for all G query heads sharing it. Decode
tokens of a mixed batch are simply requests with q_len 1.

The host plan (``plan_blocks``) lists (request, first row) per program once per step; the kernel
reads q offsets and lengths from ``cu_seqlens_q`` and ``kv_lens`` on the device.
Owns nothing; writes ``out``.
"""

from __future__ import annotations

from typing import Sequence

import torch

_K = {}
LOG2E = 1.4426950408889634


def _build():
    import triton
    import triton.language as tl

    from kvfit.kernels.tile_math import build as build_tile_math

    softcap_logits = build_tile_math()

    @triton.jit
    def _prefill(Q, KC, VC, BT, CU, KVLEN, BLK, OUT,
                 qk_scale, softcap, window, v_scale,
                 stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_cp, stride_ch, stride_bt,
                 G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
                 F16: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        req = tl.load(BLK + 2 * pid)
        row0 = tl.load(BLK + 2 * pid + 1)
        q_start = tl.load(CU + req)
        q_len = tl.load(CU + req + 1) - q_start
        kv_len = tl.load(KVLEN + req)
        prefix = kv_len - q_len
        r = row0 + tl.arange(0, BLOCK_M)
        tok = r // G
        hq = h * G + r % G
        rmask = tok < q_len
        qpos = prefix + tok  # [BLOCK_M]
        d = tl.arange(0, D)
        q = tl.load(Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + hq[:, None] * stride_qh
                    + d[None, :], mask=rmask[:, None], other=0.0)
        if F16:  # fp8 pages: float16 MMAs (one packed cvt per two fp8 values; bf16 needs two)
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        last_tok = tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)
        hi = prefix + last_tok + 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, prefix + row0 // G - window + 1)
        bt_row = BT + req.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        if V_T:  # page-slice aligned tiles: tokens below lo fall outside every row's window
            lo = lo // BLOCK_N * BLOCK_N
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            if V_T:
                # V pages token-minor [H, D, P]: addresses per page slice, loads masked per
                # page (16-byte vectors), dead tokens of a live page zeroed after the load
                PP: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
                NP: tl.constexpr = BLOCK_N // PP
                first = n0 + tl.arange(0, NP) * PP
                pmask = first < hi
                pg = tl.load(bt_row + first // PAGE, mask=pmask, other=0).to(tl.int64)
                base = pg * stride_cp + head_off
                tp = tl.multiple_of(n0 % PAGE, PP) + tl.arange(0, PP)
                k = tl.load(KC + base[:, None, None] + (tp * D)[None, :, None]
                            + d[None, None, :], mask=pmask[:, None, None], other=0.0)
                k = tl.reshape(k, (BLOCK_N, D)).to(q.dtype)  # [NP, PP, D] -> [BLOCK_N, D]
                vt = tl.load(VC + base[None, :, None] + (d * PAGE)[:, None, None]
                             + tp[None, None, :], mask=pmask[None, :, None], other=0.0)
                v = tl.trans(tl.reshape(vt, (D, BLOCK_N))).to(q.dtype)  # [BLOCK_N, D]
                v = tl.where(nmask[:, None], v, 0.0)
            else:
                page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
                off = page * stride_cp + head_off + (n % PAGE) * D
                k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None],
                            other=0.0).to(q.dtype)
                v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None],
                            other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            if HAS_SOFTCAP:
                qk = softcap_logits(qk, qk_scale, softcap)
            else:
                qk = qk * qk_scale
            vis = (n[None, :] <= qpos[:, None]) & nmask[None, :]
            if HAS_WINDOW:
                vis = vis & (n[None, :] > qpos[:, None] - window)
            qk = tl.where(vis, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None] * v_scale
        tl.store(OUT + (q_start + tok).to(tl.int64)[:, None] * stride_ot + hq[:, None] * stride_oh
                 + d[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])

    return _prefill


def prefill_block_m(head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
    """Rows (token x head pairs) per program. Measured on the H200 (docs/kernels.md): 64 rows and
    4 warps for 16-bit pages (1.06-1.12x FlashInfer fa2's time on 128-d heads; 128 rows:
    1.2-1.3x) and for fp8 pages of 64-d heads (0.61-0.66x; 128 rows: 0.90-0.96x); 128 rows and
    8 warps for fp8 pages of 128-d heads (1.37-1.46x; 64 rows: 1.5-1.6x)."""
    if q_dtype == torch.float32 or kv_dtype == torch.float32:
        return 16
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and head_dim == 128:
        return 128
    return 64


def plan_blocks(q_lens: Sequence[int], group: int, block_m: int, device) -> torch.Tensor:
    """[NB, 2] int32 (request, first row) for every program of a step (host work, one copy)."""
    flat: list[int] = []
    for i, ql in enumerate(q_lens):
        rows = ql * group
        for r0 in range(0, rows, block_m):
            flat += (i, r0)
    return torch.tensor(flat, dtype=torch.int32).view(-1, 2).to(device, non_blocking=True)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                  blocks: torch.Tensor, block_m: int, out: torch.Tensor, sm_scale: float,
                  k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None,
                  window: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  v_t: bool = False) -> torch.Tensor:
    """q ``[T, Hq, D]`` -> ``out [T, Hq, D]`` (written) for the programs listed in ``blocks``.

    K pages ``[pages, Hkv, P, D]``; V the same, or token-minor ``[pages, Hkv, D, P]`` if ``v_t``."""
    if "k" not in _K:
        _K["k"] = _build()
    kern = _K["k"]
    nb = blocks.shape[0]
    if nb == 0:
        return out
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    fp32 = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    if fp32:  # exact float32 products (no tf32) for float32 queries or pools
        block_n = block_n or 16
        num_warps = num_warps or 4
        num_stages = num_stages or 1
    else:
        block_n = block_n or (64 if d <= 128 else 32)
        num_warps = num_warps or (8 if block_m >= 128 else 4)
        num_stages = num_stages or 2
    kern[(nb, hkv)](
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, blocks, out,
        float(sm_scale * k_scale * LOG2E), float(softcap or 0.0), int(window or 0), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        G=hq // hkv, D=d, PAGE=k_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, V_T=v_t,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
        PREC="ieee" if fp32 else "tf32",
        F16=k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and not fp32,
        num_warps=num_warps, num_stages=num_stages)
    return out
