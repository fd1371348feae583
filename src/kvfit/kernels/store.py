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

import functools

import numpy as np
import torch

from kvfit.transfer import to_device


@functools.cache
def build():
    """The jitted (slot-mapped store kernel, page-chunk store kernel, the element function
    ``_quant`` that other kernels storing into pools share), built once per process on first
    use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # the Triton interpreter looks them up there

    from kvfit.kernels.tile_math import build as build_tile_math

    request_span = build_tile_math().request_span

    @triton.jit
    def _quant(x, inv, max_finite, QUANT: tl.constexpr, SCALED: tl.constexpr):
        # the pool's element function: cast(clamp(x * (1/scale))) in float32 for quantized
        # formats; (x * (1/scale)) rounded to x's dtype for 16/32-bit pools (the caller casts)
        if QUANT:
            xf = x.to(tl.float32)
            if SCALED:
                xf = xf * inv
            return tl.minimum(tl.maximum(xf, -max_finite), max_finite)
        elif SCALED:
            return (x.to(tl.float32) * inv).to(x.dtype)
        else:
            return x

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
        kf = _quant(k, k_inv, max_finite, QUANT, SCALED)
        vf = _quant(v, v_inv, max_finite, QUANT, SCALED)
        tl.store(KC + dst, kf.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst_v, vf.to(VC.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_chunks_kernel(K, V, KC, VC, CHUNKS, CU, KVLEN, BT, k_inv, v_inv, max_finite,
                             stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cp, stride_ch, stride_bt,
                             D: tl.constexpr, PAGE: tl.constexpr, PP: tl.constexpr,
                             QUANT: tl.constexpr, SCALED: tl.constexpr):
        # program (chunk, head): the new tokens of one request at positions [a, a + PP), one
        # page's slice (PP divides PAGE, a % PP == 0), into token-minor V pages [H, D, P]
        c = tl.program_id(0)
        h = tl.program_id(1)
        req = tl.load(CHUNKS + 2 * c)
        a = tl.load(CHUNKS + 2 * c + 1)
        q_start, q_len, prefix = request_span(CU, KVLEN, req)
        pos = a + tl.arange(0, PP)
        live = (pos >= prefix) & (pos < prefix + q_len)  # [PP]
        tok = (q_start + pos - prefix).to(tl.int64)
        page = tl.load(BT + req.to(tl.int64) * stride_bt + a // PAGE).to(tl.int64)
        base = page * stride_cp + h * stride_ch
        off = tl.multiple_of(a % PAGE, PP) + tl.arange(0, PP)  # PP neighbouring slots
        d = tl.arange(0, D)
        k = tl.load(K + tok[:, None] * stride_kt + h * stride_kh + d[None, :], mask=live[:, None])
        v = tl.load(V + tok[:, None] * stride_vt + h * stride_vh + d[None, :], mask=live[:, None])
        kf = _quant(k, k_inv, max_finite, QUANT, SCALED)
        vf = _quant(v, v_inv, max_finite, QUANT, SCALED)
        tl.store(KC + base + off[:, None] * D + d[None, :], kf.to(KC.dtype.element_ty),
                 mask=live[:, None])
        # [PP, D] -> [D, PP]: the slots are contiguous along PP, so each page row's PP tokens
        # are written as whole 16-byte vectors (instead of one byte each PAGE bytes apart);
        # positions of the slice that are not new keep the bytes read back (no other program
        # of the launch writes this slice: it belongs to one request's new tokens)
        vptr = VC + base + (d * PAGE)[:, None] + off[None, :]
        vt = tl.where(live[None, :], tl.trans(vf.to(VC.dtype.element_ty)), tl.load(vptr))
        tl.store(vptr, vt)

    return _store_kv_kernel, _store_chunks_kernel, _quant


def _checked(k, v, k_cache, v_cache, fmt, k_scale, v_scale, v_layout, who):
    """Host side shared by both stores: k/v with a contiguous last dim, the cache layout check
    and the kernels' scale arguments (quant, scaled, 1/k_scale, 1/v_scale, max_finite)."""
    import numpy as np

    d = k.shape[-1]
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if (k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or v_cache.stride(-1) != 1
            or k_cache.stride()[:2] != v_cache.stride()[:2]
            or v_cache.shape[-1] != (k_cache.shape[2] if v_layout == "HDN" else d)):
        raise ValueError(f"{who} needs contiguous [page_size, head_dim] K slabs and V slabs in "
                         f"the {v_layout} layout")
    quant = bool(fmt.quantized)
    # torch divides a tensor by a Python scalar as x * (1/s) with 1/s computed in float32
    # (its CUDA reciprocal fast path); the same product gives bit-identical stores
    inv = [float(np.float32(1.0) / np.float32(s)) for s in (k_scale, v_scale)]
    scaled = k_scale != 1.0 or v_scale != 1.0
    return k, v, (quant, scaled, inv[0], inv[1], float(fmt.max_finite) if quant else 0.0)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, fmt, k_scale: float = 1.0, v_scale: float = 1.0,
             v_layout: str = "HND") -> None:
    """k, v ``[T, Hkv, D]`` (last dim contiguous) -> caches ``[num_pages, Hkv, P, D]`` at slots
    (V ``[num_pages, Hkv, D, P]`` with ``v_layout="HDN"``).

    ``fmt`` is the pool's ``KVFormat``. Mutates ``k_cache`` and ``v_cache``. No host syncs.
    """
    t, h, d = k.shape
    if t == 0:
        return
    k, v, (quant, scaled, k_inv, v_inv, max_finite) = _checked(
        k, v, k_cache, v_cache, fmt, k_scale, v_scale, v_layout, "store_kv")
    import triton

    block = triton.next_power_of_2(h * d)
    build()[0][(t,)](k, v, k_cache, v_cache, slot_mapping, k_inv, v_inv, max_finite,
                     k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     k_cache.stride(0), k_cache.stride(1),
                     H=h, D=d, PAGE=k_cache.shape[2], BLOCK=block, QUANT=quant,
                     SCALED=scaled, V_T=v_layout == "HDN",
                     num_warps=4 if block >= 1024 else 2)


def chunk_tokens(page_size: int) -> int:
    """Tokens per program of ``store_kv_chunks``: a page, at most 32 (a 32-byte fp8 sector)."""
    return min(page_size, 32)


def split_store_chunks(q_lens, kv_lens, page_size: int, device) -> torch.Tensor:
    """[NC, 2] int32 (request, first position) covering every request's new positions
    ``[kv_len - q_len, kv_len)`` in page-aligned chunks of ``chunk_tokens(page_size)``."""
    pp = chunk_tokens(page_size)
    flat: list[int] = []
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for a in range((kl - ql) // pp * pp, kl, pp):
            flat += (i, a)
    # pinned: a pageable copy would wait for the GPU's earlier work (kvfit.transfer)
    return to_device(np.asarray(flat, dtype=np.int32).reshape(-1, 2), torch.device(device))


def store_kv_chunks(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, chunks: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    kv_lens: torch.Tensor, block_table: torch.Tensor, fmt, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """``store_kv`` into token-minor V pages for a step with several tokens per request.

    k, v ``[T, Hkv, D]`` hold the requests' new tokens back to back (``cu_seqlens_q``), at
    positions ``kv_len - q_len ..`` mapped to slots through ``block_table``; ``chunks`` is
    ``split_store_chunks``. Writes the same bytes as ``store_kv`` with the equivalent slot
    mapping, with a page row's tokens written together. Mutates the caches. No host syncs."""
    t, h, d = k.shape
    if t == 0 or chunks.shape[0] == 0:
        return
    k, v, (quant, scaled, k_inv, v_inv, max_finite) = _checked(
        k, v, k_cache, v_cache, fmt, k_scale, v_scale, "HDN", "store_kv_chunks")
    page = k_cache.shape[2]
    build()[1][(chunks.shape[0], h)](
        k, v, k_cache, v_cache, chunks, cu_seqlens_q, kv_lens, block_table, k_inv, v_inv,
        max_finite, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        D=d, PAGE=page, PP=chunk_tokens(page), QUANT=quant, SCALED=scaled,
        num_warps=4 if d * chunk_tokens(page) >= 2048 else 2)
