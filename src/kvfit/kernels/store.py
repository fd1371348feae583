"""Fused quantize-on-store (Triton): one launch per layer writes a step's new K and V into pages.

Owns nothing; mutates the two cache tensors it is given. For each token t with slot s >= 0 it
writes ``k[t]`` to ``k_cache[s // P, :, s % P, :]`` (HND pages) and likewise ``v`` (or to
``v_cache[s // P, :, :, s % P]`` when V pages are token-minor, ``v_layout="HDN"``), computing
``cast(clamp(x / scale, -max_finite, max_finite))`` in float32 for quantized formats, which is the
same function (same round-to-nearest-even cast, same scale arithmetic) as
``kvfit.kvcache.quant.quantize`` on CUDA (torch divides by a Python scalar as a multiply by the
float32 reciprocal; so does this kernel); for 16/32-bit pools ``x / scale`` rounded to x's dtype,
then cast (a plain cast at scale 1). Slots < 0 are skipped.
"""

from __future__ import annotations

import torch

_KERNEL = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, SLOT, k_inv, v_inv, max_finite,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cp, stride_ch,
                         H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, SCALED: tl.constexpr,
                         V_T: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOT + t)
        if slot < 0:
            return
        page = slot // PAGE
        off = slot % PAGE
        idx = tl.arange(0, BLOCK)  # flattened (head, d)
        h = idx // D
        d = idx % D
        mask = idx < H * D
        dst = page * stride_cp + h * stride_ch + off * D + d
        if V_T:
            dst_v = page * stride_cp + h * stride_ch + d * PAGE + off
        else:
            dst_v = dst
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        if QUANT:
            kf = k.to(tl.float32)
            vf = v.to(tl.float32)
            if SCALED:
                kf = kf * k_inv
                vf = vf * v_inv
            kf = tl.minimum(tl.maximum(kf, -max_finite), max_finite)
            vf = tl.minimum(tl.maximum(vf, -max_finite), max_finite)
        elif SCALED:
            # (x / scale) rounded to x's dtype, then cast: quantize()'s order of roundings
            kf = (k.to(tl.float32) * k_inv).to(K.dtype.element_ty)
            vf = (v.to(tl.float32) * v_inv).to(V.dtype.element_ty)
        else:
            kf = k
            vf = v
        tl.store(KC + dst, kf.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst_v, vf.to(VC.dtype.element_ty), mask=mask)

    return _store_kv_kernel


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, fmt, k_scale: float = 1.0, v_scale: float = 1.0,
             v_layout: str = "HND") -> None:
    """k, v ``[T, Hkv, D]`` (last dim contiguous) -> caches ``[num_pages, Hkv, P, D]`` at slots
    (V ``[num_pages, Hkv, D, P]`` with ``v_layout="HDN"``).

    ``fmt`` is the pool's ``KVFormat``. Mutates ``k_cache`` and ``v_cache``. No host syncs.
    """
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    v_t = v_layout == "HDN"
    if (k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or v_cache.stride(-1) != 1
            or k_cache.stride()[:2] != v_cache.stride()[:2]
            or v_cache.shape[-1] != (k_cache.shape[2] if v_t else d)):
        raise ValueError("store_kv needs contiguous [page_size, head_dim] K slabs and V slabs "
                         f"in the {v_layout} layout")
    import numpy as np
    import triton

    block = triton.next_power_of_2(h * d)
    quant = bool(fmt.quantized)
    scaled = k_scale != 1.0 or v_scale != 1.0
    # torch divides a tensor by a Python scalar as x * (1/s) with 1/s computed in float32
    # (its CUDA reciprocal fast path); the same product gives bit-identical stores
    k_inv = float(np.float32(1.0) / np.float32(k_scale))
    v_inv = float(np.float32(1.0) / np.float32(v_scale))
    _KERNEL[(t,)](k, v, k_cache, v_cache, slot_mapping, k_inv, v_inv,
                  float(fmt.max_finite) if quant else 0.0,
                  k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  k_cache.stride(0), k_cache.stride(1),
                  H=h, D=d, PAGE=k_cache.shape[2], BLOCK=block, QUANT=quant, SCALED=scaled, V_T=v_t,
                  num_warps=4 if block >= 1024 else 2)
