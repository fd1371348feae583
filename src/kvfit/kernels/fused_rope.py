"""Fused rotate-half RoPE for q and k in one Triton launch: the CUDA path of
``models.layers.RotaryEmbedding``.

Owns nothing; returns new contiguous ``q``/``k`` tensors, or writes the caller's ``q_out``/
``k_out`` (inputs are not written). For each token
``t`` it gathers ``cos[positions[t]]``/``sin[...]`` from the float32 tables (``[max_pos, rot]``),
casts them to q's dtype like the torch path, and computes on the first ``rot`` dims

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[rot/2:], x[:rot/2])

rounding each product and the sum to q's dtype exactly as torch's elementwise ops do (each op
computed in float32, rounded once), so 16-bit outputs equal the torch path bit for bit; float32
inputs may differ in the last bit (the compiler may fuse the multiply-add). Dims ``rot..head_dim``
(partial rotary) are copied through. q and k may be strided views (last dim contiguous).
Optionally a per-head RMSNorm of q and k runs first in the same launch (``qk_norm``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kvfit.kernels.hadamard import fwht, fwht_scale
from kvfit.kernels.interpret import expose_for_interpreter
from kvfit.kernels.outputs import check_out
from kvfit.kernels.pdl import launch_options


@functools.cache
def build():
    """The jitted RoPE kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.hadamard import build as build_hadamard
    from kvfit.kernels.row_quant import build as build_row_quant
    from kvfit.kernels.store import build as build_store

    from kvfit.kernels.pdl import gdc

    fwht_rows = build_hadamard()
    quant = build_store()[2]  # the pool's element function, shared with the store kernels
    rq = build_row_quant()
    scale_i8, apply_i8, quant_rows_i8 = rq.scale_i8, rq.apply_i8, rq.quant_rows_i8
    row_amax, max_nan = rq.row_amax, rq.max_nan
    gdc_wait, gdc_launch_dependents = gdc()

    @triton.jit
    def _store_rows(C, base, stride_ch, heads, cols, col_stride, x, mask, inv, max_finite,
                    QUANT: tl.constexpr, SCALED: tl.constexpr):
        # x [BLOCK_H, n] of one token -> cache rows of ``heads`` at element offsets cols
        xf = quant(x, inv, max_finite, QUANT, SCALED)
        tl.store(C + base + heads[:, None] * stride_ch + cols[None, :] * col_stride,
                 xf.to(C.dtype.element_ty), mask=mask)

    @triton.jit
    def _halves(r1, r2, BLOCK_H: tl.constexpr, D: tl.constexpr):
        # two halves [BLOCK_H, D/2] -> one float32 row [BLOCK_H, D] (r1 first)
        first = (tl.arange(0, 2) == 0)[None, :, None]
        x = tl.where(first, r1.to(tl.float32)[:, None, :], r2.to(tl.float32)[:, None, :])
        return tl.reshape(x, (BLOCK_H, D))  # [BLOCK_H, 2, D/2] -> rows

    @triton.jit
    def _store_k_rotated(KC, KS, KM, kb, sbase, stride_ch, heads, hm, full, k_inv, max_finite,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, LOG2D: tl.constexpr,
                         HSCALE: tl.constexpr, QUANT: tl.constexpr, SCALED: tl.constexpr,
                         ROWS: tl.constexpr, HAS_KMEAN: tl.constexpr):
        # k rows [BLOCK_H, D] (float32, after RoPE) -> (k - mu) @ H into the cache rows
        dd = tl.arange(0, D)
        fm = hm[:, None] & (dd < D)[None, :]
        if HAS_KMEAN:
            full = full - tl.load(KM + heads[:, None] * D + dd[None, :], mask=fm, other=0.0)
        kr = tl.where(fm, fwht_rows(full, BLOCK_H, D, LOG2D, HSCALE), 0.0)
        dst = KC + kb + heads[:, None] * stride_ch + dd[None, :]
        if ROWS:
            kq, ksc = quant_rows_i8(kr)
            tl.store(KS + sbase, ksc, mask=hm)
            tl.store(dst, kq, mask=fm)
        else:
            tl.store(dst, quant(kr, k_inv, max_finite, QUANT, SCALED).to(KC.dtype.element_ty),
                     mask=fm)

    @triton.jit
    def _rope_kernel(Q, K, QO, KO, POS, COS, SIN, QW, KW, sq0, sq1, sk0, sk1, sc, ss, eps, offset,
                     V, KC, VC, KS, VS, KM, SLOT, sv0, sv1, stride_cp, stride_ch, stride_sp,
                     stride_sh, k_inv, v_inv, max_finite,
                     HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
                     NORM: tl.constexpr, HAS_OFFSET: tl.constexpr, STORE: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                     SCALED: tl.constexpr, V_T: tl.constexpr, ROWS: tl.constexpr,
                     HAS_KMEAN: tl.constexpr, ROTATE: tl.constexpr, LOG2D: tl.constexpr,
                     HSCALE: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)  # head blocks of q, then of k (then of v, with STORE)
        NQB: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
        NKB: tl.constexpr = (HK + BLOCK_H - 1) // BLOCK_H
        if STORE:
            slot = tl.load(SLOT + t)
            page_base = (slot // PAGE) * stride_cp
            off = slot % PAGE
            if hb >= NQB + NKB:  # v: quantize-on-store only (no rotation)
                if slot >= 0:
                    vh = (hb - NQB - NKB) * BLOCK_H + tl.arange(0, BLOCK_H)
                    dd = tl.arange(0, BLOCK_D)
                    vm = (vh < HK)[:, None] & (dd < D)[None, :]
                    v = tl.load(V + t * sv0 + vh[:, None] * sv1 + dd[None, :], mask=vm,
                                other=0.0)
                    if ROWS:  # int8: the row's scale, then the row as int8
                        v, vsc = quant_rows_i8(v.to(tl.float32))
                        tl.store(VS + (slot // PAGE) * stride_sp + vh * stride_sh + off, vsc,
                                 mask=vh < HK)
                    if V_T:  # token-minor V pages [H, D, P]
                        _store_rows(VC, page_base + off, stride_ch, vh, dd, PAGE, v, vm, v_inv,
                                    max_finite, QUANT and not ROWS, SCALED)
                    else:
                        _store_rows(VC, page_base + off * D, stride_ch, vh, dd, 1, v, vm, v_inv,
                                    max_finite, QUANT and not ROWS, SCALED)
                return
        pos = tl.load(POS + t).to(tl.int64)
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        ty = Q.dtype.element_ty
        # the tables cast to q's dtype first, as the torch path does
        c1 = tl.load(COS + pos * sc + j, mask=jm, other=0.0).to(ty).to(tl.float32)
        c2 = tl.load(COS + pos * sc + HALF + j, mask=jm, other=0.0).to(ty).to(tl.float32)
        s1 = tl.load(SIN + pos * ss + j, mask=jm, other=0.0).to(ty).to(tl.float32)
        s2 = tl.load(SIN + pos * ss + HALF + j, mask=jm, other=0.0).to(ty).to(tl.float32)
        if hb < NQB:
            X, OUT, W, h0, sx0, sx1, nh = Q, QO, QW, hb * BLOCK_H, sq0, sq1, HQ
        else:
            X, OUT, W, h0, sx0, sx1, nh = K, KO, KW, (hb - NQB) * BLOCK_H, sk0, sk1, HK
        heads = h0 + tl.arange(0, BLOCK_H)
        hm = heads < nh
        m = hm[:, None] & jm[None, :]
        src = X + t * sx0 + heads[:, None] * sx1 + j[None, :]
        dst = OUT + t * (nh * D) + heads[:, None] * D + j[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        p = tl.arange(0, BLOCK_P if BLOCK_P > 0 else 1)
        pm = hm[:, None] & (p < D - 2 * HALF)[None, :]
        poff = 2 * HALF + p[None, :]
        if BLOCK_P > 0:  # partial rotary: dims [2*HALF, D) pass through (normed if NORM)
            xp = tl.load(X + t * sx0 + heads[:, None] * sx1 + poff, mask=pm, other=0.0)
        if NORM:  # q/k RMSNorm over each head's D dims first, rounded as models.layers.RMSNorm
            sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if BLOCK_P > 0:
                xpf = xp.to(tl.float32)
                sq += tl.sum(xpf * xpf, axis=1)
            rstd = tl.rsqrt(sq / D + eps)[:, None]
            w1 = tl.load(W + j, mask=jm, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(W + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
            if HAS_OFFSET:
                x1 = (x1 * rstd * (offset + w1)).to(ty).to(tl.float32)
                x2 = (x2 * rstd * (offset + w2)).to(ty).to(tl.float32)
            else:
                x1 = ((x1 * rstd).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
                x2 = ((x2 * rstd).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
            if BLOCK_P > 0:
                wp = tl.load(W + poff, mask=poff < D, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    xp = (xpf * rstd * (offset + wp)).to(ty)
                else:
                    xp = ((xpf * rstd).to(ty).to(tl.float32) * wp).to(ty)
        # torch: (x*cos) rounded, (rotate_half(x)*sin) rounded, their sum rounded
        a1 = (x1 * c1[None, :]).to(ty).to(tl.float32)
        b1 = (-x2 * s1[None, :]).to(ty).to(tl.float32)
        a2 = (x2 * c2[None, :]).to(ty).to(tl.float32)
        b2 = (x1 * s2[None, :]).to(ty).to(tl.float32)
        r1 = (a1 + b1).to(ty)
        r2 = (a2 + b2).to(ty)
        if ROTATE:  # the KV transform's rotation (full rotary, D a power of two)
            full = _halves(r1, r2, BLOCK_H, D)  # [BLOCK_H, D] float32
            if hb < NQB:  # q: returned rotated, q @ H
                dd = tl.arange(0, D)
                tl.store(OUT + t * (nh * D) + heads[:, None] * D + dd[None, :],
                         fwht_rows(full, BLOCK_H, D, LOG2D, HSCALE).to(ty),
                         mask=hm[:, None] & (dd < D)[None, :])
            else:  # k: returned as RoPE left it; stored as (k - mu) @ H
                tl.store(dst, r1, mask=m)
                tl.store(dst + HALF, r2, mask=m)
                if slot >= 0:
                    _store_k_rotated(KC, KS, KM, page_base + off * D,
                                     (slot // PAGE) * stride_sp + heads * stride_sh + off,
                                     stride_ch, heads, hm, full, k_inv, max_finite, D, BLOCK_H,
                                     LOG2D, HSCALE, QUANT, SCALED, ROWS, HAS_KMEAN)
            return
        tl.store(dst, r1, mask=m)
        tl.store(dst + HALF, r2, mask=m)
        if BLOCK_P > 0:
            tl.store(OUT + t * (nh * D) + heads[:, None] * D + poff, xp.to(ty), mask=pm)
        if STORE:
            if hb >= NQB:  # k: the rotated values, as store_kv would read them back
                if slot >= 0:
                    kb = page_base + off * D
                    k1 = r1
                    k2 = r2
                    if BLOCK_P > 0:
                        kp = xp.to(ty)
                    if HAS_KMEAN:  # K centering: k - mu[head] in float32
                        mrow = KM + heads[:, None] * D
                        k1 = r1.to(tl.float32) - tl.load(mrow + j[None, :], mask=m, other=0.0)
                        k2 = r2.to(tl.float32) - tl.load(mrow + HALF + j[None, :], mask=m,
                                                         other=0.0)
                        if BLOCK_P > 0:
                            kp = kp.to(tl.float32) - tl.load(mrow + poff, mask=pm, other=0.0)
                    if ROWS:  # int8: one scale over the whole row (both halves, the tail)
                        k1 = tl.where(m, k1.to(tl.float32), 0.0)
                        k2 = tl.where(m, k2.to(tl.float32), 0.0)
                        amax = max_nan(row_amax(k1), row_amax(k2))
                        if BLOCK_P > 0:
                            kp = tl.where(pm, kp.to(tl.float32), 0.0)
                            amax = max_nan(amax, row_amax(kp))
                        ksc = scale_i8(amax)
                        tl.store(KS + (slot // PAGE) * stride_sp + heads * stride_sh + off, ksc,
                                 mask=hm)
                        k1 = apply_i8(k1, ksc)
                        k2 = apply_i8(k2, ksc)
                        if BLOCK_P > 0:
                            kp = apply_i8(kp, ksc)
                    _store_rows(KC, kb, stride_ch, heads, j, 1, k1, m, k_inv, max_finite,
                                QUANT and not ROWS, SCALED)
                    _store_rows(KC, kb, stride_ch, heads, HALF + j, 1, k2, m, k_inv,
                                max_finite, QUANT and not ROWS, SCALED)
                    if BLOCK_P > 0:
                        _store_rows(KC, kb, stride_ch, heads, 2 * HALF + p, 1, kp, pm,
                                    k_inv, max_finite, QUANT and not ROWS, SCALED)

    expose_for_interpreter(globals(), locals())
    return _rope_kernel


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, q_out: Optional[torch.Tensor] = None,
               k_out: Optional[torch.Tensor] = None,
               qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float, float]] = None,
               kv_store=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]``, k ``[T, Hk, D]`` (same D and dtype), cos/sin ``[max_pos, rot]`` float32
    tables, positions ``[T]`` (int32/int64, each < max_pos) -> new rotated (q, k), contiguous.

    ``qk_norm = (q_weight [D], k_weight [D], eps, offset)`` first applies a per-head RMSNorm to
    q and k (Qwen3's and Gemma 3's q_norm/k_norm, same roundings as ``fused_norm.rms_norm``) in
    the same launch: norm, rounded to the dtype, then RoPE.

    ``kv_store = (v [T, Hk, D], KVStoreTarget)`` also writes the rotated k and v into the pool's
    pages at the target's slots in the same launch, the same bytes as ``store.store_kv`` would
    write from the returned k (mutates the target's caches; one launch fewer per layer). The
    target's ``k_mean`` is subtracted from k before it is quantized, and a rotating target
    (``rotate``: the KV transform's Hadamard rotation) stores ``(k - k_mean) @ H`` and returns
    ``q @ H`` (k is returned as RoPE left it), by a fast Walsh-Hadamard transform in registers
    (partial rotary or a head size that is not a power of two: the same in torch after the
    kernel).
    """
    import triton

    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rope wants q [T, Hq, D] and k [T, Hk, D], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"apply_rope: q is {q.dtype} but k is {k.dtype}")
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = cos.shape[-1]
    if rot % 2 or rot > d or sin.shape != cos.shape:
        raise ValueError(f"rotary table of width {rot} (sin {tuple(sin.shape)}) does not fit "
                         f"head_dim {d}: it must be even and <= head_dim")
    if (kv_store is not None and getattr(kv_store[1], "rotate", False)
            and (rot != d or d & (d - 1))):
        return _rope_then_rotated_store(q, k, cos, sin, positions, q_out, k_out, qk_norm,
                                        kv_store)
    q, k = _last_contig(q), _last_contig(k)
    cos, sin = _last_contig(cos), _last_contig(sin)
    qo, ko = check_out(q_out, q, "q_out"), check_out(k_out, k, "k_out")
    if t == 0:
        return qo, ko
    half = rot // 2
    bp = triton.next_power_of_2(d - rot) if d > rot else 0
    bhalf = triton.next_power_of_2(half)
    # up to ~2048 rotated pairs per program: all heads of q (or k) for small models
    bh = min(triton.next_power_of_2(max(hq, hk)), max(1, 2048 // bhalf))
    num_warps = min(8, max(1, bh * bhalf // 256))
    grid = (t, triton.cdiv(hq, bh) + triton.cdiv(hk, bh))
    if qk_norm is None:
        qw, kw, eps, offset = q, k, 0.0, 0.0  # weights unused
    else:
        qw, kw, eps, offset = qk_norm
        if qw.shape != (d,) or kw.shape != (d,):
            raise ValueError(f"q/k norm weights of shapes {tuple(qw.shape)}, {tuple(kw.shape)} "
                             f"do not match head_dim {d}")
    if kv_store is None:
        store_args, store_kw = (q, q, q, q, q, q, positions, 0, 0, 0, 0, 0, 0, 1.0, 1.0,
                                0.0), dict(STORE=False, PAGE=1, BLOCK_D=1, QUANT=False,
                                           SCALED=False, V_T=False, ROWS=False, HAS_KMEAN=False,
                                           ROTATE=False, LOG2D=0, HSCALE=1.0)
    else:
        store_args, store_kw = _store_arguments(kv_store, k, t, hk, d)
        grid = (t, grid[1] + triton.cdiv(hk, bh))  # + the v head blocks
    build()[grid](q, k, qo, ko, positions, cos, sin, qw, kw, q.stride(0), q.stride(1),
                  k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), float(eps),
                  float(offset), *store_args, HQ=hq, HK=hk, D=d, HALF=half, BLOCK_H=bh,
                  BLOCK_HALF=bhalf, BLOCK_P=bp, NORM=qk_norm is not None,
                  HAS_OFFSET=bool(offset), num_warps=num_warps, **store_kw,
                  **launch_options(q.device))
    return qo, ko


def _rope_then_rotated_store(q, k, cos, sin, positions, q_out, k_out, qk_norm, kv_store):
    """``apply_rope`` with a rotating store target, unfused: RoPE, then q @ H and the store of
    (k - k_mean) @ H (torch butterflies, ``kernels.hadamard.fwht``)."""
    from kvfit.kernels.store import store_kv

    v, target = kv_store
    qo, ko = apply_rope(q, k, cos, sin, positions, q_out, k_out, qk_norm)
    qo.copy_(fwht(qo))
    kt = ko.float() if target.k_mean is None else ko.float() - target.k_mean
    store_kv(fwht(kt), v, target.k_cache, target.v_cache, target.slot_mapping, target.fmt,
             target.k_scale, target.v_scale, target.v_layout, k_scale_cache=target.k_scale_cache,
             v_scale_cache=target.v_scale_cache)
    return qo, ko


def _store_arguments(kv_store, k: torch.Tensor, t: int, hk: int, d: int):
    """The kernel's store arguments for ``kv_store = (v, KVStoreTarget)``, checked like
    ``store_kv`` checks its inputs (same cache layout rules, same scale arithmetic)."""
    import triton

    from kvfit.kernels.store import _checked, row_scale_args

    v, target = kv_store
    if v.shape != (t, hk, d) or v.dtype != k.dtype:
        raise ValueError(f"kv_store: v must be [T, Hk, D] = {(t, hk, d)} of {k.dtype}, got "
                         f"{tuple(v.shape)} of {v.dtype}")
    kc, vc = target.k_cache, target.v_cache
    _, v, (quant, scaled, k_inv, v_inv, max_finite) = _checked(
        k, v, kc, vc, target.fmt, target.k_scale, target.v_scale, target.v_layout,
        "apply_rope(kv_store=...)")
    rows, ks, vs, km, ssp, ssh, has_mean = row_scale_args(
        kc, getattr(target, "k_scale_cache", None), getattr(target, "v_scale_cache", None),
        getattr(target, "k_mean", None), d, "apply_rope(kv_store=...)")
    args = (v, kc, vc, ks, vs, km, target.slot_mapping, v.stride(0), v.stride(1), kc.stride(0),
            kc.stride(1), ssp, ssh, k_inv, v_inv, max_finite)
    rotate = bool(getattr(target, "rotate", False))
    kw = dict(STORE=True, PAGE=kc.shape[2], BLOCK_D=triton.next_power_of_2(d), QUANT=quant,
              SCALED=scaled and not rows, V_T=target.v_layout == "HDN", ROWS=rows,
              HAS_KMEAN=has_mean, ROTATE=rotate, LOG2D=d.bit_length() - 1,
              HSCALE=fwht_scale(d) if rotate else 1.0)
    return args, kw
