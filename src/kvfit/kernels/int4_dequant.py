"""Full int4 pool pages dequantized into a compact 16-bit paged cache in one Triton launch (the
int4 prefill reads its requests' pages this way: attention/triton_int4.py's ``PrefillPages``).

Program (i, h): pool page ``pages[i]`` of KV head h -> ``k_out[dst[i], h]``, ``v_out[dst[i], h]``
``[P, D]``: ``code * scale + zero`` in float32, rounded once to the output dtype, as
``kvfit.kvcache.kivi``'s reference dequantizers (K per channel of the page, its scale and zero
stored even channels first; V per token and 32 channels, token-major or token-minor pages, the
pool's ``v_layout``). Owns nothing; writes ``k_out`` and ``v_out``.
"""

from __future__ import annotations

import functools

import torch

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build():
    """The jitted kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # jit signatures name tl.constexpr

    @triton.jit
    def _int4_dequant_pages(KC, VC, KS, KZ, VS, VZ, PAGES, DST, KO, VO, stride_cp, stride_ch,
                            stride_kp, stride_kh, stride_vp, stride_vh, stride_op, stride_oh,
                            D: tl.constexpr, PAGE: tl.constexpr, V_T: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        NG: tl.constexpr = D // 32
        page = tl.load(PAGES + i).to(tl.int64)
        dst = tl.load(DST + i).to(tl.int64)
        t = tl.arange(0, PAGE)
        c = tl.arange(0, D)  # channel
        j = c // 2  # its byte in a token-major row
        hi = (c % 2) == 1
        base = page * stride_cp + h * stride_ch
        # K: the page's codes [PAGE, D], scale and zero per channel (even-first rows)
        kb = tl.load(KC + base + t[:, None] * HALF + j[None, :])
        kq = tl.where(hi[None, :], kb >> 4, kb & 15).to(tl.float32)
        sidx = page * stride_kp + h * stride_kh + tl.where(hi, HALF + j, j)
        ks = tl.load(KS + sidx).to(tl.float32)
        kz = tl.load(KZ + sidx).to(tl.float32)
        orow = dst * stride_op + h * stride_oh + t[:, None] * D + c[None, :]
        tl.store(KO + orow, (kq * ks[None, :] + kz[None, :]).to(KO.dtype.element_ty))
        # V: codes [PAGE, D], scale and zero per token and group of 32 channels
        if V_T:  # token-minor: byte (c, t // 2), the even token in the low nibble
            vb = tl.load(VC + base + c[None, :] * (PAGE // 2) + (t // 2)[:, None])
            vq = tl.where(((t % 2) == 1)[:, None], vb >> 4, vb & 15).to(tl.float32)
            vidx = (page * stride_vp + h * stride_vh + (c // 32)[None, :] * PAGE
                    + t[:, None])
        else:
            vb = tl.load(VC + base + t[:, None] * HALF + j[None, :])
            vq = tl.where(hi[None, :], vb >> 4, vb & 15).to(tl.float32)
            vidx = page * stride_vp + h * stride_vh + t[:, None] * NG + (c // 32)[None, :]
        vs = tl.load(VS + vidx).to(tl.float32)
        vz = tl.load(VZ + vidx).to(tl.float32)
        tl.store(VO + orow, (vq * vs + vz).to(VO.dtype.element_ty))

    expose_for_interpreter(globals(), locals())
    return _int4_dequant_pages


def int4_dequant_pages(pool, layer_id: int, pages: torch.Tensor, dst: torch.Tensor,
                       k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Pool pages ``pages [n]`` (full ones) of layer ``layer_id`` of an ``Int4KVCache`` into
    rows ``dst [n]`` of ``k_out``, ``v_out`` ``[N, Hkv, P, D]`` (contiguous, a 16- or 32-bit
    dtype). Writes those rows only."""
    n = pages.numel()
    if n == 0:
        return
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    hkv, d = kc.shape[1], 2 * kc.shape[3]
    if not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError("int4_dequant_pages writes contiguous [N, Hkv, P, D] outputs")
    build()[(n, hkv)](
        kc, vc, ks, kz, vs, vz, pages, dst, k_out, v_out, kc.stride(0), kc.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), k_out.stride(0),
        k_out.stride(1), D=d, PAGE=pool.page_size, V_T=pool.v_layout == "HDN",
        num_warps=4 if d <= 128 else 8)
