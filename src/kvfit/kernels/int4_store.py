"""The int4 pool's stores in Triton: a decode step's in one launch (one new token per request,
``int4_store_decode``), and whole staged pages of a prefill step in one launch
(``int4_store_pages``).

Decode: program (b, h) writes request b's new K/V row of KV head h into its residual slot at
offset ``(kv_len - 1) % 32``; when that fills the page (offset 31) it quantizes the whole page
into the request's pool page ``block_table[b, (kv_len - 1) // 32]``. The page's earlier rows are
read from the residual slot, the new row from registers (it is not written there). Rows whose
slot is negative (CUDA-graph padding) store nothing. The grid depends only on (batch, kv
heads): no host syncs, no data-dependent shapes. Pages: program (f, h) quantizes staged page f.
Both write kvcache/kivi.py's format in either V layout of the pool, the same bytes as
``Int4KVCache.store_step``'s torch quantizer (IEEE float32 division, round half to even,
float16 scale and zero clamped as there; K's scale/zero stored even channels first). Owns
nothing; mutates the pool's residual and pages.
"""

from __future__ import annotations

import functools
import types

import torch

from kvfit.kernels.decode_int4 import PAGE as GROUP  # the int4 pool's page = K's group
from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build() -> types.SimpleNamespace:
    """The jitted store kernels (``decode``, ``pages``), built once per process on first
    use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # jit signatures name tl.constexpr

    from kvfit.kernels.row_quant import build as build_row_quant

    round_half_even = build_row_quant().round_half_even

    @triton.jit
    def _scale_zero(lo, hi):
        # float32 group minimum/maximum -> float16 scale (never zero, never Inf) and zero
        # (kivi.MIN_SCALE = 2**-14, kivi.F16_MAX = 65504)
        s = tl.math.div_rn(hi - lo, 15.0)
        s = tl.minimum(tl.maximum(s, 6.103515625e-05), 65504.0).to(tl.float16)
        z = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16)
        return s, z

    @triton.jit
    def _codes(x, s, z):
        # float32 x with float16 scale/zero (broadcast) -> codes 0..15 (uint8)
        c = round_half_even(tl.math.div_rn(x - z.to(tl.float32), s.to(tl.float32)))
        return tl.minimum(tl.maximum(c, 0.0), 15.0).to(tl.uint8)

    @triton.jit
    def _quantize_page(ke, ko, ve, vo, KC, VC, KS, KZ, VS, VZ, page, h, stride_cp, stride_ch,
                       stride_kp, stride_kh2, stride_vp, stride_vh2, D: tl.constexpr,
                       PAGE: tl.constexpr, V_T: tl.constexpr):
        # one full page of KV head h, its even and odd channels' float32 values [PAGE, D/2]
        # (ke, ko, ve, vo), quantized into pool page ``page``: codes, scales and zeros
        HALF: tl.constexpr = D // 2
        NG: tl.constexpr = D // 32
        j = tl.arange(0, HALF)
        t = tl.arange(0, PAGE)
        # K: per channel over the page's tokens
        kse, kze = _scale_zero(tl.min(ke, 0), tl.max(ke, 0))  # [D/2]
        kso, kzo = _scale_zero(tl.min(ko, 0), tl.max(ko, 0))
        kq = (_codes(ke, kse[None, :], kze[None, :])
              | (_codes(ko, kso[None, :], kzo[None, :]) << 4))
        cbase = page * stride_cp + h * stride_ch + t[:, None] * HALF + j[None, :]
        tl.store(KC + cbase, kq)
        sb = page * stride_kp + h * stride_kh2
        tl.store(KS + sb + j, kse)
        tl.store(KS + sb + HALF + j, kso)
        tl.store(KZ + sb + j, kze)
        tl.store(KZ + sb + HALF + j, kzo)
        # V: per token in groups of 32 channels (16 pairs), [PAGE, NG, 16]
        ve3 = tl.reshape(ve, (PAGE, NG, 16))
        vo3 = tl.reshape(vo, (PAGE, NG, 16))
        lo = tl.minimum(tl.min(ve3, 2), tl.min(vo3, 2))  # [PAGE, NG]
        hi = tl.maximum(tl.max(ve3, 2), tl.max(vo3, 2))
        vs, vz = _scale_zero(lo, hi)
        vqe = _codes(ve3, vs[:, :, None], vz[:, :, None])
        vqo = _codes(vo3, vs[:, :, None], vz[:, :, None])
        g = tl.arange(0, NG)
        if V_T:  # token-minor: a byte holds tokens (2i, 2i + 1) of a channel
            vc = tl.reshape(tl.join(vqe, vqo), (PAGE // 2, 2, D))  # [tokens, channels]
            tok_e, tok_o = tl.split(tl.permute(vc, (0, 2, 1)))  # [PAGE/2, D] each
            i = tl.arange(0, PAGE // 2)
            d = tl.arange(0, D)
            vaddr = (page * stride_cp + h * stride_ch + d[None, :] * (PAGE // 2)
                     + i[:, None])
            tl.store(VC + vaddr, tok_e | (tok_o << 4))
            vb = page * stride_vp + h * stride_vh2 + g[None, :] * PAGE + t[:, None]
        else:
            tl.store(VC + cbase, tl.reshape(vqe | (vqo << 4), (PAGE, HALF)))
            vb = page * stride_vp + h * stride_vh2 + t[:, None] * NG + g[None, :]
        tl.store(VS + vb, vs)
        tl.store(VZ + vb, vz)

    @triton.jit
    def _int4_store_pages(KP, VP, PAGES, KC, VC, KS, KZ, VS, VZ, stride_sf, stride_sp,
                          stride_sh, stride_cp, stride_ch, stride_kp, stride_kh2, stride_vp,
                          stride_vh2, D: tl.constexpr, PAGE: tl.constexpr, V_T: tl.constexpr):
        # program (f, h): staged page f ([PAGE, D] of KP/VP at f, h; strides of [F, P, H, D])
        # quantized into pool page PAGES[f]
        f = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.arange(0, D // 2)
        t = tl.arange(0, PAGE)
        row = (f.to(tl.int64) * stride_sf + h * stride_sh + t[:, None] * stride_sp
               + 2 * j[None, :])
        ke = tl.load(KP + row).to(tl.float32)
        ko = tl.load(KP + row + 1).to(tl.float32)
        ve = tl.load(VP + row).to(tl.float32)
        vo = tl.load(VP + row + 1).to(tl.float32)
        page = tl.load(PAGES + f).to(tl.int64)
        _quantize_page(ke, ko, ve, vo, KC, VC, KS, KZ, VS, VZ, page, h, stride_cp, stride_ch,
                       stride_kp, stride_kh2, stride_vp, stride_vh2, D, PAGE, V_T)

    @triton.jit
    def _int4_store_decode(K, V, KR, VR, KC, VC, KS, KZ, VS, VZ, BT, KVLEN, SLOTS,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_rs, stride_rh,
                           stride_cp, stride_ch, stride_kp, stride_kh2, stride_vp, stride_vh2,
                           stride_bt, D: tl.constexpr, PAGE: tl.constexpr,
                           V_T: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(SLOTS + b)
        if slot >= 0:
            HALF: tl.constexpr = D // 2
            pos = tl.load(KVLEN + b) - 1
            off = pos % PAGE
            j = tl.arange(0, HALF)
            t = tl.arange(0, PAGE)
            # the new row as even/odd channel halves, in the residual's dtype
            k_e = tl.load(K + b * stride_kt + h * stride_kh + 2 * j).to(KR.dtype.element_ty)
            k_o = tl.load(K + b * stride_kt + h * stride_kh + 2 * j + 1).to(KR.dtype.element_ty)
            v_e = tl.load(V + b * stride_vt + h * stride_vh + 2 * j).to(VR.dtype.element_ty)
            v_o = tl.load(V + b * stride_vt + h * stride_vh + 2 * j + 1).to(VR.dtype.element_ty)
            rrow = slot.to(tl.int64) * stride_rs + h * stride_rh
            if off < PAGE - 1:  # the page stays partial: the row waits in the residual slot
                tl.store(KR + rrow + off * D + 2 * j, k_e)
                tl.store(KR + rrow + off * D + 2 * j + 1, k_o)
                tl.store(VR + rrow + off * D + 2 * j, v_e)
                tl.store(VR + rrow + off * D + 2 * j + 1, v_o)
            else:  # the page is full: quantize it into the pool
                new = (t == off)[:, None]
                rp = KR + rrow + t[:, None] * D + 2 * j[None, :]  # [PAGE, D/2]
                ke = tl.where(new, k_e[None, :], tl.load(rp)).to(tl.float32)
                ko = tl.where(new, k_o[None, :], tl.load(rp + 1)).to(tl.float32)
                rv = VR + rrow + t[:, None] * D + 2 * j[None, :]
                ve = tl.where(new, v_e[None, :], tl.load(rv)).to(tl.float32)
                vo = tl.where(new, v_o[None, :], tl.load(rv + 1)).to(tl.float32)
                page = tl.load(BT + b.to(tl.int64) * stride_bt + pos // PAGE).to(tl.int64)
                _quantize_page(ke, ko, ve, vo, KC, VC, KS, KZ, VS, VZ, page, h, stride_cp,
                               stride_ch, stride_kp, stride_kh2, stride_vp, stride_vh2, D, PAGE,
                               V_T)

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(decode=_int4_store_decode, pages=_int4_store_pages)


def int4_store_decode(pool, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                      block_table: torch.Tensor, kv_lens: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """Store a decode step's k, v ``[B, Hkv, D]`` (one token per request) into layer
    ``layer_id`` of an ``Int4KVCache``: ``kv_lens [B]`` int32 counts each request's tokens after
    this step, ``slots [B]`` int32 its residual slot (< 0: store nothing). Mutates the pool."""
    if pool.page_size != GROUP:
        raise ValueError(f"the int4 store writes pages of {GROUP} tokens, the pool has "
                         f"{pool.page_size}")
    b, hkv, d = k.shape
    kr, vr = pool.k_residual[layer_id], pool.v_residual[layer_id]
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    build().decode[(b, hkv)](
        k, v, kr, vr, kc, vc, ks, kz, vs, vz, block_table, kv_lens, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kr.stride(0), kr.stride(1),
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        block_table.stride(0), D=d, PAGE=pool.page_size, V_T=pool.v_layout == "HDN",
        num_warps=4 if d <= 128 else 8)


def int4_store_pages(pool, layer_id: int, k_pages: torch.Tensor, v_pages: torch.Tensor,
                     pages: torch.Tensor) -> None:
    """Quantize whole staged pages into layer ``layer_id`` of an ``Int4KVCache``, one launch:
    ``k_pages``, ``v_pages`` ``[F, P, Hkv, D]`` (the residual's dtype, any strides with D
    contiguous), ``pages [F]`` the pool pages they become (the same bytes as
    ``Int4KVCache.store_step``'s torch quantizer). Mutates the pool's pages and scales."""
    f, p, hkv, d = k_pages.shape
    if p != GROUP or pool.page_size != GROUP:
        raise ValueError(f"the int4 store writes pages of {GROUP} tokens, got {p}")
    if k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages need the same strides, D contiguous")
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    build().pages[(f, hkv)](
        k_pages, v_pages, pages, kc, vc, ks, kz, vs, vz, k_pages.stride(0), k_pages.stride(1),
        k_pages.stride(2), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0),
        vs.stride(1), D=d, PAGE=p, V_T=pool.v_layout == "HDN", num_warps=4 if d <= 128 else 8)
