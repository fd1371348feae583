"""Paged split-K decode attention (Triton), GQA-aware, dequantizing KV pages in registers.

One query token per request. Program (b, h, s) loads the G query heads that share KV head h once,
walks split s of request b's cached tokens in tiles of BLOCK_N tokens (through the block table),
and keeps an online softmax in float32. Each KV tile is loaded once for the whole query group.
fp8 pages are converted in registers; the per-tensor K scale is folded into the softmax scale and
the V scale into the output. With more than one split, a second small kernel merges the partial
results by their log-sum-exp.

Two kernels: the tensor-core one (``tl.dot``, query group padded to 16 rows), used for 16-bit
queries, and a CUDA-core one (float32 FMAs over the real query rows only) for float32 queries or
pools. On the tensor-core path fp8 tiles become float16 (one packed ``cvt.rn.f16x2.e4m3x2`` per two
elements on sm_89+; bfloat16 would need a detour through float32), with the K scale folded in.

The fp8 trick (``v_pairs``, docs/kernels.md): Triton builds the P@V operand from an fp8 V tile
with byte-wide shared-memory loads (``LDS.U8``, one per element: the operand needs V transposed and
ldmatrix cannot transpose 8-bit data). Reading V as 16-bit words, converting each word with one
packed cvt and re-interleaving in registers (join + reshape) makes the operand come from float16
through ``ldmatrix.trans`` like a bf16 tile: no byte loads, ~30% fewer instructions per element.

Owns nothing; writes ``out`` (and scratch ``op``/``lse`` when splitting). No host syncs: the grid
depends only on (batch, kv heads, splits), so a launch is CUDA-graph capturable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_K = {}
LOG2E = 1.4426950408889634


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_pairs_to_f16(w, E5M2: tl.constexpr):
        # w: [N, D/2] uint16 words, each two fp8 values of a row -> [N, D] f16. One packed
        # cvt per word; join + reshape keeps the converted tile in registers in a row layout, so
        # the tensor-core operand is built from f16 through shared memory (ldmatrix.trans)
        # instead of byte-wise loads of the fp8 tile.
        if E5M2:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 r; cvt.rn.f16x2.e5m2x2 r, $2; mov.b32 {$0, $1}, r; }",
                "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; mov.b32 {$0, $1}, r; }",
                "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        return tl.reshape(tl.join(lo, hi), (w.shape[0], 2 * w.shape[1]))

    @triton.jit
    def _decode_split(Q, KC, VC, BT, KVLEN, OUT, OP, LSE,
                      qk_scale, softcap, window, v_scale,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_cp, stride_ch, stride_bt,
                      num_splits,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      BLOCK_N: tl.constexpr, F16: tl.constexpr,
                      E5M2: tl.constexpr, V_PAIRS: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SINGLE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kv_len = tl.load(KVLEN + b)
        per = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, kv_len)
        if HAS_WINDOW:
            start = tl.maximum(start, kv_len - window)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        q = tl.load(Q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        if F16:
            q = q.to(tl.float16)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
            off = page * stride_cp + head_off + (n % PAGE) * D  # [BLOCK_N]
            k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            if V_PAIRS:
                d2 = tl.arange(0, D // 2)
                vw = tl.load(VC.to(tl.pointer_type(tl.uint16)) + (off // 2)[:, None] + d2[None, :],
                             mask=nmask[:, None], other=0)
                v = _fp8_pairs_to_f16(vw, E5M2)
            else:
                v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            if F16:
                k = k.to(tl.float16)
                if not V_PAIRS:
                    v = v.to(tl.float16)
            else:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            qk = tl.dot(q, tl.trans(k))  # [G_PAD, BLOCK_N] f32
            if HAS_SOFTCAP:
                # softcap * tanh(x * sm_scale / softcap), base-2 logits afterwards
                x = qk * (qk_scale / 1.4426950408889634 / softcap)
                e = tl.exp(-2.0 * tl.abs(x))
                th = (1.0 - e) / (1.0 + e)
                th = tl.where(x < 0, -th, th)
                qk = th * (softcap * 1.4426950408889634)
            else:
                qk = qk * qk_scale
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        hq = h * G + g
        if SINGLE:
            tl.store(OUT + b * stride_ot + hq[:, None] * stride_oh + d[None, :],
                     (o * v_scale).to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + hq) * num_splits + s  # [G_PAD]
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    @triton.jit
    def _decode_merge(OP, LSE, OUT, v_scale, stride_ot, stride_oh, num_splits, HQ,
                      D: tl.constexpr, S_PAD: tl.constexpr):
        b = tl.program_id(0)
        hq = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        row = (b * HQ + hq) * num_splits + sp
        smask = sp < num_splits
        lse = tl.load(LSE + row, mask=smask, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx)
        den = tl.sum(w, axis=0)
        den = tl.where(den > 0, den, 1.0)
        o = tl.load(OP + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(o * w[:, None], axis=0) / den
        tl.store(OUT + b * stride_ot + hq * stride_oh + d, (o * v_scale).to(OUT.dtype.element_ty))

    @triton.jit
    def _decode_split_fma(Q, KC, VC, BT, KVLEN, OUT, OP, LSE,
                          qk_scale, softcap, window, v_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_cp, stride_ch, stride_bt,
                          num_splits,
                          G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          SINGLE: tl.constexpr):
        # CUDA-core path for small groups: only the G real query rows are computed. Partial
        # sums stay per (row, token slot, d) across tiles and are reduced once at the end, and
        # the running max is only moved when it grows by more than 2^8 (exact: the final
        # normalisation uses the same stale max), so a tile costs ~2G FMAs per KV element.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kv_len = tl.load(KVLEN + b)
        per = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, kv_len)
        if HAS_WINDOW:
            start = tl.maximum(start, kv_len - window)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        q = tl.load(Q + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0).to(tl.float32)
        if not HAS_SOFTCAP:
            q = q * qk_scale
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l3 = tl.zeros([G_PAD, BLOCK_N], tl.float32)
        acc3 = tl.zeros([G_PAD, BLOCK_N, D], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        head_off = h * stride_ch
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
            off = page * stride_cp + head_off + (n % PAGE) * D
            k = tl.load(KC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(VC + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, N]
            if HAS_SOFTCAP:
                x = qk * (qk_scale / 1.4426950408889634 / softcap)
                e = tl.exp(-2.0 * tl.abs(x))
                th = (1.0 - e) / (1.0 + e)
                th = tl.where(x < 0, -th, th)
                qk = th * (softcap * 1.4426950408889634)
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                acc3 = acc3 * alpha[:, None, None]
                l3 = l3 * alpha[:, None]
                m_i = m_new
            p = tl.exp2(qk - m_i[:, None])
            l3 += p
            acc3 += p[:, :, None] * v.to(tl.float32)[None, :, :]
        l_i = tl.sum(l3, axis=1)
        acc = tl.sum(acc3, axis=1)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        hq = h * G + g
        if SINGLE:
            tl.store(OUT + b * stride_ot + hq[:, None] * stride_oh + d[None, :],
                     (o * v_scale).to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + hq) * num_splits + s
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    return _decode_split, _decode_merge, _decode_split_fma


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices for one decode call (fixed per CUDA-graph batch size)."""

    num_splits: int
    block_n: int
    use_dot: bool  # tensor-core tl.dot (query group padded to 16 rows) or the CUDA-core path
    num_warps: int
    num_stages: int
    v_pairs: bool = False  # fp8 V read as 16-bit pairs, converted before the operand shuffle
    maxnreg: int | None = None  # register cap per thread (more programs per SM)


def choose_config(batch: int, num_kv_heads: int, group: int, head_dim: int, max_kv_len: int,
                  kv_dtype: torch.dtype, q_dtype: torch.dtype, num_sms: int = 132,
                  use_dot: bool | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  v_pairs: bool | None = None, maxnreg: int | None = None,
                  ctas_per_sm: int | None = None) -> DecodeConfig:
    """Tile and path per dtype, and a wave-aware split count (measured: docs/kernels.md).

    ``batch * kv_heads * splits`` programs run ``ctas_per_sm`` at a time per SM (ncu: the fp8
    tile is register-limited to 2, the bf16 one to 4), so the split count minimises the number of
    waves per unit of work, ceil(programs / slots) / splits, with splits of >= 256 tokens and a
    1%-per-split merge cost; e.g. 64 programs on 264 slots take 4 splits (one full wave), not 5.
    16-bit 64-d tiles keep the earlier rule (~4 programs per SM), which measured better there.
    """
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if use_dot is None:
        use_dot = q_dtype in (torch.bfloat16, torch.float16) and kv_dtype != torch.float32
    if block_n is None:
        if not use_dot:
            block_n = 16
        elif fp8:
            block_n = 128 if head_dim <= 128 else 64
        else:
            block_n = 64 if head_dim <= 128 else 32
    if ctas_per_sm is None:
        if not use_dot:
            ctas_per_sm = 4
        elif fp8:
            ctas_per_sm = 4 if head_dim <= 64 else 2
        else:
            ctas_per_sm = 4 if head_dim <= 128 else 2
    programs = max(1, batch * num_kv_heads)
    max_splits = int(min(64, max(1, math.ceil(max(1, max_kv_len) / 256))))
    if use_dot and not fp8 and head_dim <= 64:
        # 16-bit 64-d tiles: measured best with ~4 programs per SM of splits (v2 rule); the
        # wave model picked more splits here and lost 5-18% (docs/kernels.md)
        splits = min(max_splits, max(1, math.ceil(4 * num_sms / programs)))
    else:
        slots = num_sms * ctas_per_sm
        best = (float("inf"), 1)
        for sp in range(1, max_splits + 1):
            cost = math.ceil(programs * sp / slots) / sp * (1 + 0.01 * sp)
            if cost < best[0] - 1e-12:
                best = (cost, sp)
        splits = best[1]
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 3 if use_dot else 2
    if v_pairs is None:
        v_pairs = fp8
    return DecodeConfig(splits, block_n, use_dot, num_warps, num_stages, v_pairs, maxnreg)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor,
                 sm_scale: float, cfg: DecodeConfig, k_scale: float = 1.0, v_scale: float = 1.0,
                 softcap: float | None = None, window: int | None = None,
                 scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` (one token per request) over HND pages -> ``out [B, Hq, D]`` (written).

    ``scratch`` = (op ``[>= B*Hq*S, D]`` f32, lse ``[>= B*Hq*S]`` f32) lets CUDA-graph callers pass
    static buffers; otherwise they are allocated here when ``cfg.num_splits > 1``.
    """
    if "k" not in _K:
        _K["k"] = _build()
    split_k, merge_k, split_fma = _K["k"]
    import triton

    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    g_pad = max(triton.next_power_of_2(group), 16 if cfg.use_dot else 1)
    s = cfg.num_splits
    single = s == 1
    if single:
        op = lse = out  # unused
    elif scratch is not None:
        op, lse = scratch
    else:
        op = torch.empty((b * hq * s, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b * hq * s,), dtype=torch.float32, device=q.device)
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    args = (q, k_cache, v_cache, block_table, kv_lens, out, op, lse,
            float(sm_scale * k_scale * LOG2E), float(softcap or 0.0), int(window or 0),
            float(v_scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), block_table.stride(0), s)
    common = dict(G=group, G_PAD=g_pad, D=d, PAGE=k_cache.shape[2], BLOCK_N=cfg.block_n,
                  HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None, SINGLE=single,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        common["maxnreg"] = cfg.maxnreg
    if cfg.use_dot:
        split_k[(b, hkv, s)](*args, F16=fp8, E5M2=k_cache.dtype == torch.float8_e5m2,
                             V_PAIRS=fp8 and cfg.v_pairs, **common)
    else:
        split_fma[(b, hkv, s)](*args, **common)
    if not single:
        merge_k[(b, hq)](op, lse, out, float(v_scale), out.stride(0), out.stride(1), s, hq,
                         D=d, S_PAD=triton.next_power_of_2(s), num_warps=4 if d >= 128 else 2)
    return out
