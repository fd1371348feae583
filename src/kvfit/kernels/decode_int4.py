"""Paged decode attention over the int4 pool (Triton): packed 4-bit pages + the residual page.

One query token per request. Program (b, h, s) loads the G query heads that share KV head h (as
their even and odd channel halves, padded to 16 rows for ``tl.dot``), walks split s of request
b's full pages ``NPG`` pages (``NPG * 32`` tokens) per loop iteration, software-pipelined over
``num_stages``, then (last split only) its full-precision residual page (``kv_len % 32``
tokens), with an online softmax in float32 (base-2 logits). Per tile, in registers:

* codes ``[NPG, 32, D/32, 16]`` bytes of K and V: a byte's low nibble is an even channel, its
  high nibble the odd one, so K and V become even/odd float16 halves ``[NPG * 32, D/2]``
  (kernels/nibbles.py: no int->float conversion instruction on the GPU) and the logits are
  ``q_even . K_even + q_odd . K_odd``, the output the even and odd halves of ``P @ V``;
* K's per-channel scale and zero ``[NPG, 1, D/32, 16]`` per page and V's per token and
  32-channel group ``[NPG, 32, D/32, 1]`` are loaded once each and broadcast into the
  dequantization (``code * scale + zero``, one float16 rounding).

Float32 queries take the exact path (float32 values, IEEE products). Split-K as the fp8 decode:
with more than one split the decode merge kernel (``decode_kernels``) combines the partial
outputs by their base-2 log-sum-exp. The grid depends only on (batch, kv heads, splits): no host
syncs, CUDA-graph capturable. Owns nothing; writes ``out`` (and the split scratch).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvfit.kernels.interpret import expose_for_interpreter

LOG2E = 1.4426950408889634
PAGE = 32  # the int4 pool's page = K's quantization group


@dataclass(frozen=True)
class Int4DecodeConfig:
    """Launch choices of one int4 decode call (fixed per CUDA-graph batch size)."""

    num_splits: int
    pages_per_tile: int = 2  # NPG: pages (of 32 tokens) per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True  # 16-bit queries: nibbles -> float16 by inline asm (False: casts)
    maxnreg: int | None = None  # register cap per thread (more programs per SM)
    # one page a step with K's scale folded into the query (q*s) . codes + q . zero, codes as
    # exact float16 0..15 (no scale/zero per element); pages_per_tile is then 1
    fold_k: bool = False
    # K's scale/zero loaded once per token of the tile (redundant addresses: the loads then take
    # the codes' register layout) instead of once per page (one value per thread)
    ks_tokens: bool = False
    # K's codes read row-major ([pages, tokens, D/2], as V's) and its scale/zero per token; the
    # K tile then reaches the MMA transposed through shared memory (else: read as K^T)
    k_rows: bool = False


# per head size: (pages per tile, warps, stages, register cap, programs per SM it allows);
# compiled for sm_90 without spills (``cuobjdump -res-usage``)
TILES = {64: (2, 4, 3, 96, 4), 128: (2, 4, 3, None, 2), 256: (2, 8, 2, None, 2)}


@functools.lru_cache(maxsize=1024)
def choose_config(batch: int, num_kv_heads: int, head_dim: int, max_kv_len: int,
                  num_sms: int = 132, pages_per_tile: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  ctas_per_sm: int | None = None) -> Int4DecodeConfig:
    """Tile and a wave-aware split count: ``batch * kv_heads * splits`` programs on
    ``num_sms * ctas_per_sm`` slots, the split count minimising waves per unit of work with
    splits of >= 4 tiles and a 1%-per-split merge cost (as the fp8 decode's rule). An explicit
    tile (pages, warps, stages) runs without the register cap of the measured default."""
    npg, warps, stages, maxnreg, per_sm = TILES.get(head_dim, TILES[256])
    if (pages_per_tile, num_warps, num_stages) != (None, None, None):
        npg, warps, stages = pages_per_tile or npg, num_warps or warps, num_stages or stages
        maxnreg, per_sm = None, 2
    per_sm = ctas_per_sm or per_sm
    programs = max(1, batch * num_kv_heads)
    tile = npg * PAGE
    max_splits = int(min(64, max(1, math.ceil(max(1, max_kv_len) / (4 * tile)))))
    slots = num_sms * per_sm
    best = (float("inf"), 1)
    for sp in range(1, max_splits + 1):
        cost = math.ceil(programs * sp / slots) / sp * (1 + 0.01 * sp)
        if cost < best[0] - 1e-12:
            best = (cost, sp)
    return Int4DecodeConfig(best[1], npg, warps, stages, maxnreg=maxnreg)


@functools.cache
def build():
    """The jitted kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # jit signatures name tl.constexpr

    from kvfit.kernels.nibbles import build as build_nibbles

    nib = build_nibbles()
    dequant_lo, dequant_hi, dequant_cast = nib.dequant_lo, nib.dequant_hi, nib.dequant_cast
    codes_lo, codes_hi, codes_cast = nib.codes_lo, nib.codes_hi, nib.codes_cast

    @triton.jit
    def _codes(x, HI: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
        # the even (HI False) or odd channels' codes 0..15 of packed x, float16 or float32
        if F32:
            r = codes_cast(x, HI, tl.float32)
        elif ASM:
            if HI:
                r = codes_hi(x)
            else:
                r = codes_lo(x)
        else:
            r = codes_cast(x, HI, tl.float16)
        return r

    @triton.jit
    def _dequant(x, s, z, HI: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
        # the even (HI False) or odd channels' values of packed codes x, float16 or float32
        if F32:
            r = dequant_cast(x, s, z, HI, tl.float32)
        elif ASM:
            if HI:
                r = dequant_hi(x, s, z)
            else:
                r = dequant_lo(x, s, z)
        else:
            r = dequant_cast(x, s, z, HI, tl.float16)
        return r

    @triton.jit
    def _online(qk, v, acc, m_i, l_i, PREC: tl.constexpr):
        # one tile of base-2 logits [G_PAD, N] (dead columns -inf, at least one live) into the
        # running softmax and the output [G_PAD, D]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        return acc, m_new, l_i

    @triton.jit
    def _int4_decode_kernel(Q, OUT, OP, LSE, KC, VC, KS, KZ, VS, VZ, KR, VR, BT, KVLEN, RSLOT,
                            stride_qb, stride_qh, stride_ob, stride_oh,
                            stride_cp, stride_ch, stride_kp, stride_kh, stride_vp, stride_vh,
                            stride_rs, stride_rh, stride_bt, qk_scale, num_splits,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr, NPG: tl.constexpr, F32: tl.constexpr,
                            ASM: tl.constexpr, KFOLD: tl.constexpr, KS_TOKENS: tl.constexpr,
                            KROW: tl.constexpr, SINGLE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        HALF: tl.constexpr = D // 2
        NG: tl.constexpr = D // 32  # V's channel groups; a group is 16 bytes of codes
        N: tl.constexpr = NPG * PAGE
        PREC: tl.constexpr = "ieee" if F32 else "tf32"
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, HALF)  # channel pair j: channels 2j (low nibble) and 2j + 1 (high)
        d = tl.arange(0, D)
        gmask = g < G
        qrow = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh
        q_e = tl.load(qrow + 2 * j[None, :], mask=gmask[:, None], other=0.0)
        q_o = tl.load(qrow + 2 * j[None, :] + 1, mask=gmask[:, None], other=0.0)
        if F32:
            q_e = q_e.to(tl.float32)
            q_o = q_o.to(tl.float32)
        else:
            q_e = q_e.to(tl.float16)
            q_o = q_o.to(tl.float16)
        kv_len = tl.load(KVLEN + b)
        nfull = kv_len // PAGE
        tail = kv_len - nfull * PAGE
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        per = tl.cdiv(tl.cdiv(nfull, num_splits), NPG) * NPG  # full pages per split
        p0 = s * per
        p1 = tl.minimum(p0 + per, nfull)
        ip = tl.arange(0, NPG)
        t = tl.arange(0, PAGE)
        grp = tl.arange(0, NG)
        c16 = tl.arange(0, 16)
        # K codes as K^T: [D/2, NPG, PAGE] (channel pair, page, token), the MMA's B operand shape
        kt_off = j[:, None, None] + t[None, None, :] * HALF  # [D/2, 1, PAGE]
        # V codes [NPG, PAGE, NG, 16] (page, token, channel group, pair in group)
        v_off = (t[None, :, None, None] * HALF + grp[None, None, :, None] * 16
                 + c16[None, None, None, :])
        vs_off = t[None, :, None, None] * NG + grp[None, None, :, None]  # [1, PAGE, NG, 1]
        bt_row = BT + b.to(tl.int64) * stride_bt
        if KFOLD:  # one page a step, K's scale folded into q: logits = (q*s) . codes + q . z
            q_e32 = q_e.to(tl.float32)
            q_o32 = q_o.to(tl.float32)
            kt_off1 = j[:, None] + t[None, :] * HALF  # [D/2, PAGE]: K^T codes
            v_off1 = t[:, None, None] * HALF + grp[None, :, None] * 16 + c16[None, None, :]
            vs_off1 = t[:, None, None] * NG + grp[None, :, None]  # [PAGE, NG, 1]
            for p in range(p0, p1):
                pg = tl.load(bt_row + p).to(tl.int64)
                cb = pg * stride_cp + h * stride_ch
                kb = tl.load(KC + cb + kt_off1)  # [D/2, PAGE] uint8
                kso = pg * stride_kp + h * stride_kh
                ks_e = tl.load(KS + kso + j).to(tl.float32)  # [D/2], pool order: evens first
                ks_o = tl.load(KS + kso + HALF + j).to(tl.float32)
                kz_e = tl.load(KZ + kso + j).to(tl.float32)
                kz_o = tl.load(KZ + kso + HALF + j).to(tl.float32)
                qs_e = (q_e32 * ks_e[None, :]).to(q_e.dtype)  # [G_PAD, D/2]
                qs_o = (q_o32 * ks_o[None, :]).to(q_e.dtype)
                qz = tl.sum(q_e32 * kz_e[None, :] + q_o32 * kz_o[None, :], 1)  # [G_PAD]
                qk = tl.dot(qs_e, _codes(kb, False, F32, ASM), input_precision=PREC)
                qk = tl.dot(qs_o, _codes(kb, True, F32, ASM), qk, input_precision=PREC)
                qk = (qk + qz[:, None]) * qk_scale  # [G_PAD, PAGE]
                vb = tl.load(VC + cb + v_off1)  # [PAGE, NG, 16]
                vso = pg * stride_vp + h * stride_vh + vs_off1
                vs = tl.load(VS + vso)  # [PAGE, NG, 1]
                vz = tl.load(VZ + vso)
                v_e = _dequant(vb, vs, vz, False, F32, ASM)
                v_o = _dequant(vb, vs, vz, True, F32, ASM)
                v = tl.reshape(tl.join(v_e, v_o), (PAGE, D))  # channels back in order
                acc, m_i, l_i = _online(qk, v, acc, m_i, l_i, PREC)
        else:
            for p in range(p0, p1, NPG):
                live = (p + ip) < p1  # [NPG]
                pg = tl.load(bt_row + p + ip, mask=live, other=0).to(tl.int64)
                cb = pg * stride_cp + h * stride_ch  # [NPG]
                if KROW:  # K row-major like V: a thread dequantizes 16 bytes of one token
                    lv = live[:, None, None, None]
                    kb = tl.load(KC + cb[:, None, None, None] + v_off, mask=lv, other=0)
                    # the page's scale/zero row repeated for its tokens (L1 hits): the loads
                    # take the codes' layout ([NPG, PAGE, NG, 16], pool order: evens first)
                    kso = ((pg * stride_kp + h * stride_kh)[:, None, None, None]
                           + (grp[:, None] * 16 + c16[None, :])[None, None, :, :]
                           + 0 * t[None, :, None, None])
                    ks_e = tl.load(KS + kso, mask=lv, other=0.0)
                    ks_o = tl.load(KS + kso + HALF, mask=lv, other=0.0)
                    kz_e = tl.load(KZ + kso, mask=lv, other=0.0)
                    kz_o = tl.load(KZ + kso + HALF, mask=lv, other=0.0)
                    k_e = tl.reshape(_dequant(kb, ks_e, kz_e, False, F32, ASM), (N, HALF))
                    k_o = tl.reshape(_dequant(kb, ks_o, kz_o, True, F32, ASM), (N, HALF))
                    qk = tl.dot(q_e, tl.trans(k_e), input_precision=PREC)
                    qk = tl.dot(q_o, tl.trans(k_o), qk, input_precision=PREC)  # [G_PAD, N]
                else:
                    lk = live[None, :, None]
                    kb = tl.load(KC + cb[None, :, None] + kt_off, mask=lk, other=0)  # [D/2, NPG, PAGE]
                    # K's scale/zero: the even channels' [D/2], then the odd ones' (pool order)
                    # (the [D/2, NPG, PAGE] addresses repeat a page's row for its tokens: the loads take
                    # the codes' register layout, channels contiguous in a thread, instead of one value
                    # per thread; the repeats hit L1)
                    if KS_TOKENS:
                        kso = ((pg * stride_kp + h * stride_kh)[None, :, None] + j[:, None, None]
                               + 0 * t[None, None, :])
                    else:
                        kso = (pg * stride_kp + h * stride_kh)[None, :, None] + j[:, None, None]
                    ks_e = tl.load(KS + kso, mask=lk, other=0.0)  # [D/2, NPG, PAGE or 1]
                    ks_o = tl.load(KS + kso + HALF, mask=lk, other=0.0)
                    kz_e = tl.load(KZ + kso, mask=lk, other=0.0)
                    kz_o = tl.load(KZ + kso + HALF, mask=lk, other=0.0)
                    kt_e = tl.reshape(_dequant(kb, ks_e, kz_e, False, F32, ASM), (HALF, N))
                    kt_o = tl.reshape(_dequant(kb, ks_o, kz_o, True, F32, ASM), (HALF, N))
                    qk = tl.dot(q_e, kt_e, input_precision=PREC)
                    qk = tl.dot(q_o, kt_o, qk, input_precision=PREC)  # [G_PAD, N]
                lv = live[:, None, None, None]
                vb = tl.load(VC + cb[:, None, None, None] + v_off, mask=lv, other=0)
                vso = (pg * stride_vp + h * stride_vh)[:, None, None, None] + vs_off
                vs = tl.load(VS + vso, mask=lv, other=0.0)  # [NPG, PAGE, NG, 1]
                vz = tl.load(VZ + vso, mask=lv, other=0.0)
                v_e = _dequant(vb, vs, vz, False, F32, ASM)
                v_o = _dequant(vb, vs, vz, True, F32, ASM)
                v = tl.reshape(tl.join(v_e, v_o), (N, D))  # channels back in order
                col = tl.reshape(tl.broadcast_to(live[:, None], (NPG, PAGE)), (N,))
                qk = tl.where(col[None, :], qk * qk_scale, float("-inf"))
                acc, m_i, l_i = _online(qk, v, acc, m_i, l_i, PREC)
        if (tail > 0) & (s == num_splits - 1):  # the partial page, full precision (residual)
            slot = tl.maximum(tl.load(RSLOT + b), 0).to(tl.int64)  # padded rows: -1
            rlive = t < tail
            rrow = slot * stride_rs + h * stride_rh + t[:, None] * D
            k_e = tl.load(KR + rrow + 2 * j[None, :], mask=rlive[:, None], other=0.0)
            k_o = tl.load(KR + rrow + 2 * j[None, :] + 1, mask=rlive[:, None], other=0.0)
            v = tl.load(VR + rrow + d[None, :], mask=rlive[:, None], other=0.0)
            qk = tl.dot(q_e, tl.trans(k_e.to(q_e.dtype)), input_precision=PREC)
            qk = tl.dot(q_o, tl.trans(k_o.to(q_e.dtype)), qk, input_precision=PREC)
            qk = tl.where(rlive[None, :], qk * qk_scale, float("-inf"))
            acc, m_i, l_i = _online(qk, v.to(q_e.dtype), acc, m_i, l_i, PREC)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if SINGLE:
            orow = OUT + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :]
            tl.store(orow, o.to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:  # the merge kernel's layout: row (b * Hq + head) * splits + s, base-2 lse
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + h * G + g) * num_splits + s
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    expose_for_interpreter(globals(), locals())
    return _int4_decode_kernel


def _launch(q, pool, layer_id, block_table, kv_lens, residual_slots, out, op, lse,
            sm_scale: float, cfg: Int4DecodeConfig):
    """(jitted kernel, grid, positional args, launch options) of one decode call."""
    import triton

    b, hq, d = q.shape
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    kr, vr = pool.k_residual[layer_id], pool.v_residual[layer_id]
    hkv = kc.shape[1]
    group = hq // hkv
    # float16 products for 16-bit queries (as the fp8 kernels: 11-bit mantissa, K up to ~220 in
    # real models is far inside its range); exact float32 when the query or residual is float32
    f32 = torch.float32 in (q.dtype, kr.dtype)
    args = (q, out, op, lse, kc, vc, ks, kz, vs, vz, kr, vr, block_table, kv_lens,
            residual_slots, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
            kr.stride(0), kr.stride(1), block_table.stride(0), sm_scale * LOG2E,
            cfg.num_splits)
    opts = dict(G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d,
                PAGE=pool.page_size, NPG=1 if cfg.fold_k else cfg.pages_per_tile, F32=f32,
                ASM=cfg.asm and not f32, KFOLD=cfg.fold_k, KS_TOKENS=cfg.ks_tokens,
                KROW=cfg.k_rows,
                SINGLE=cfg.num_splits == 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return build(), (b, hkv, cfg.num_splits), args, opts


def int4_decode(q: torch.Tensor, pool, layer_id: int, block_table: torch.Tensor,
                kv_lens: torch.Tensor, residual_slots: torch.Tensor, out: torch.Tensor,
                sm_scale: float, cfg: Int4DecodeConfig | None = None,
                scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` over layer ``layer_id`` of an ``Int4KVCache`` -> ``out [B, Hq, D]``.

    ``block_table [B, max_pages]`` int32, ``kv_lens [B]`` int32 (tokens cached, including the
    residual's), ``residual_slots [B]`` int32 (each request's slot), ``cfg`` the launch
    (``choose_config``; default: chosen here from ``kv_lens``' bound, the block table's width).
    ``scratch`` = (op ``[>= B*Hq*S, D]`` f32, lse ``[>= B*Hq*S]`` f32): static split buffers for
    CUDA-graph callers (else allocated here). Writes ``out``.
    """
    import triton

    b, hq, d = q.shape
    if pool.page_size != PAGE:
        raise ValueError(f"int4_decode reads pages of {PAGE} tokens, the pool has "
                         f"{pool.page_size}")
    if cfg is None:
        cfg = choose_config(b, pool.k_caches[layer_id].shape[1], d,
                            block_table.shape[1] * PAGE)
    single = cfg.num_splits == 1
    if single:
        op = lse = out  # unused
    elif scratch is not None:
        n = b * hq * cfg.num_splits
        op, lse = scratch[0][:n], scratch[1][:n]
    else:
        op = torch.empty((b * hq * cfg.num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b * hq * cfg.num_splits,), dtype=torch.float32, device=q.device)
    kern, grid, args, opts = _launch(q, pool, layer_id, block_table, kv_lens, residual_slots,
                                     out, op, lse, sm_scale, cfg)
    kern[grid](*args, **opts)
    if not single:
        from kvfit.kernels.decode_kernels import build as build_decode

        merge = build_decode()[1]
        merge[(b, hq)](op, lse, out, 1.0, out.stride(0), out.stride(1), cfg.num_splits, hq, D=d,
                       S_PAD=triton.next_power_of_2(cfg.num_splits),
                       num_warps=4 if d >= 128 else 2)
    return out
