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

from kvfit.kernels.hadamard import fwht_scale
from kvfit.kernels.interpret import expose_for_interpreter
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

    from kvfit.kernels.row_quant import build as build_row_quant

    from kvfit.kernels.hadamard import build as build_hadamard

    request_span = build_tile_math().request_span
    quant_rows_i8 = build_row_quant().quant_rows_i8
    fwht_rows = build_hadamard()

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
    def _store_kv_kernel(K, V, KC, VC, KS, VS, KM, SLOT, k_inv, v_inv, max_finite,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cp, stride_ch, stride_sp, stride_sh,
                         H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                         SCALED: tl.constexpr, V_T: tl.constexpr, ROWS: tl.constexpr,
                         HAS_KMEAN: tl.constexpr):
        # one program per token: all its heads [BLOCK_H, BLOCK_D]
        t = tl.program_id(0)
        slot = tl.load(SLOT + t)
        if slot < 0:
            return
        page = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hm = h < H
        mask = hm[:, None] & (d < D)[None, :]
        k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if HAS_KMEAN:  # K centering: k - mu[head] in float32, then the format's element function
            k = k.to(tl.float32) - tl.load(KM + h[:, None] * D + d[None, :], mask=mask, other=0.0)
        base = page * stride_cp + h * stride_ch  # [BLOCK_H]
        dst = base[:, None] + off * D + d[None, :]
        if V_T:
            dst_v = base[:, None] + d[None, :] * PAGE + off
        else:
            dst_v = dst
        if ROWS:  # int8, one float16 scale per (token, head)
            kq, ks = quant_rows_i8(k.to(tl.float32))
            vq, vs = quant_rows_i8(v.to(tl.float32))
            tl.store(KC + dst, kq, mask=mask)
            tl.store(VC + dst_v, vq, mask=mask)
            soff = page * stride_sp + h * stride_sh + off
            tl.store(KS + soff, ks, mask=hm)
            tl.store(VS + soff, vs, mask=hm)
        else:
            kf = _quant(k, k_inv, max_finite, QUANT, SCALED)
            vf = _quant(v, v_inv, max_finite, QUANT, SCALED)
            tl.store(KC + dst, kf.to(KC.dtype.element_ty), mask=mask)
            tl.store(VC + dst_v, vf.to(VC.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_chunks_kernel(K, V, KC, VC, KS, VS, KM, CHUNKS, CU, KVLEN, BT, k_inv, v_inv,
                             max_finite, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cp, stride_ch, stride_sp, stride_sh, stride_bt,
                             D: tl.constexpr, PAGE: tl.constexpr, PP: tl.constexpr,
                             QUANT: tl.constexpr, SCALED: tl.constexpr, ROWS: tl.constexpr,
                             HAS_KMEAN: tl.constexpr, ROTATE: tl.constexpr = False,
                             LOG2D: tl.constexpr = 0, HSCALE: tl.constexpr = 1.0):
        # program (chunk, head): the new tokens of one request at positions [a, a + PP), one
        # page's slice (PP divides PAGE, a % PP == 0), into token-minor V pages [H, D, P];
        # ROTATE: k rows stored as (k - mu) @ H (the KV transform's rotation, butterflies)
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
        k = tl.load(K + tok[:, None] * stride_kt + h * stride_kh + d[None, :], mask=live[:, None],
                    other=0.0)
        v = tl.load(V + tok[:, None] * stride_vt + h * stride_vh + d[None, :], mask=live[:, None],
                    other=0.0)
        if HAS_KMEAN:
            k = k.to(tl.float32) - tl.load(KM + h * D + d)[None, :]
        if ROTATE:
            k = fwht_rows(k.to(tl.float32), PP, D, LOG2D, HSCALE)
        if ROWS:
            kq, ks = quant_rows_i8(k.to(tl.float32))
            vq, vs = quant_rows_i8(v.to(tl.float32))
            soff = page * stride_sp + h * stride_sh + off
            tl.store(KS + soff, ks, mask=live)
            tl.store(VS + soff, vs, mask=live)
        else:
            kq = _quant(k, k_inv, max_finite, QUANT, SCALED).to(KC.dtype.element_ty)
            vq = _quant(v, v_inv, max_finite, QUANT, SCALED).to(VC.dtype.element_ty)
        tl.store(KC + base + off[:, None] * D + d[None, :], kq, mask=live[:, None])
        # [PP, D] -> [D, PP]: the slots are contiguous along PP, so each page row's PP tokens
        # are written as whole 16-byte vectors (instead of one byte each PAGE bytes apart);
        # positions of the slice that are not new keep the bytes read back (no other program
        # of the launch writes this slice: it belongs to one request's new tokens)
        vptr = VC + base + (d * PAGE)[:, None] + off[None, :]
        vt = tl.where(live[None, :], tl.trans(vq), tl.load(vptr))
        tl.store(vptr, vt)

    expose_for_interpreter(globals(), locals())
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


def row_scale_args(k_cache: torch.Tensor, k_scale_cache, v_scale_cache, k_mean, head_dim: int,
                   who: str):
    """The int8 / K-centering arguments of a store kernel: (rows, KS, VS, KM, stride_sp,
    stride_sh, has_kmean). int8 caches need their float16 scale caches ``[pages, Hkv, P]``;
    ``k_mean`` is a float32 ``[Hkv, D]`` tensor on the caches' device, or None."""
    rows = k_cache.dtype == torch.int8
    if rows:
        want = tuple(k_cache.shape[:3])
        for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if (sc is None or tuple(sc.shape) != want or sc.dtype != torch.float16
                    or not sc.is_contiguous() or sc.device != k_cache.device):
                got = "None" if sc is None else f"{sc.dtype} {tuple(sc.shape)}"
                raise ValueError(f"{who}: int8 caches need {name} as a contiguous float16 "
                                 f"tensor of shape {want} (pages, kv heads, page size), got {got}")
        ks, vs = k_scale_cache, v_scale_cache
        ssp, ssh = ks.stride(0), ks.stride(1)
    else:
        ks = vs = k_cache
        ssp = ssh = 0
    if k_mean is not None:
        want = (k_cache.shape[1], head_dim)
        if (tuple(k_mean.shape) != want or k_mean.dtype != torch.float32
                or not k_mean.is_contiguous() or k_mean.device != k_cache.device):
            raise ValueError(f"{who}: k_mean must be a contiguous float32 tensor of shape {want} "
                             f"on {k_cache.device}, got {k_mean.dtype} {tuple(k_mean.shape)} on "
                             f"{k_mean.device}")
    km = k_cache if k_mean is None else k_mean
    return rows, ks, vs, km, ssp, ssh, k_mean is not None


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, fmt, k_scale: float = 1.0, v_scale: float = 1.0,
             v_layout: str = "HND", k_scale_cache: torch.Tensor | None = None,
             v_scale_cache: torch.Tensor | None = None,
             k_mean: torch.Tensor | None = None) -> None:
    """k, v ``[T, Hkv, D]`` (last dim contiguous) -> caches ``[num_pages, Hkv, P, D]`` at slots
    (V ``[num_pages, Hkv, D, P]`` with ``v_layout="HDN"``).

    ``fmt`` is the pool's ``KVFormat``. int8 caches (one scale per token and head) also write
    ``k_scale_cache``/``v_scale_cache`` ``[num_pages, Hkv, P]`` float16 (the per-tensor scales
    are then unused). ``k_mean`` ``[Hkv, D]`` float32 (K centering) is subtracted from k in
    float32 before quantizing, in the same launch. Mutates the caches. No host syncs.
    """
    t, h, d = k.shape
    if t == 0:
        return
    k, v, (quant, scaled, k_inv, v_inv, max_finite) = _checked(
        k, v, k_cache, v_cache, fmt, k_scale, v_scale, v_layout, "store_kv")
    rows, ks, vs, km, ssp, ssh, has_mean = row_scale_args(k_cache, k_scale_cache, v_scale_cache,
                                                          k_mean, d, "store_kv")
    import triton

    bh, bd = triton.next_power_of_2(h), triton.next_power_of_2(d)
    build()[0][(t,)](k, v, k_cache, v_cache, ks, vs, km, slot_mapping, k_inv, v_inv, max_finite,
                     k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     k_cache.stride(0), k_cache.stride(1), ssp, ssh,
                     H=h, D=d, PAGE=k_cache.shape[2], BLOCK_H=bh, BLOCK_D=bd, QUANT=quant,
                     SCALED=scaled and not rows, V_T=v_layout == "HDN", ROWS=rows,
                     HAS_KMEAN=has_mean, num_warps=4 if bh * bd >= 1024 else 2)


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
                    v_scale: float = 1.0, k_scale_cache: torch.Tensor | None = None,
                    v_scale_cache: torch.Tensor | None = None,
                    k_mean: torch.Tensor | None = None, rotate: bool = False) -> None:
    """``store_kv`` into token-minor V pages for a step with several tokens per request.

    k, v ``[T, Hkv, D]`` hold the requests' new tokens back to back (``cu_seqlens_q``), at
    positions ``kv_len - q_len ..`` mapped to slots through ``block_table``; ``chunks`` is
    ``split_store_chunks``. Writes the same bytes as ``store_kv`` with the equivalent slot
    mapping (scale caches and ``k_mean`` as there), with a page row's tokens written together.
    ``rotate``: k is stored as ``(k - k_mean) @ H`` (the KV transform's Hadamard rotation, by
    the butterflies of ``kernels.hadamard``; D a power of two), so a prefill step needs no
    separate transform of k. Mutates the caches. No host syncs."""
    t, h, d = k.shape
    if t == 0 or chunks.shape[0] == 0:
        return
    k, v, (quant, scaled, k_inv, v_inv, max_finite) = _checked(
        k, v, k_cache, v_cache, fmt, k_scale, v_scale, "HDN", "store_kv_chunks")
    rows, ks, vs, km, ssp, ssh, has_mean = row_scale_args(k_cache, k_scale_cache, v_scale_cache,
                                                          k_mean, d, "store_kv_chunks")
    page = k_cache.shape[2]
    if rotate and d & (d - 1):
        raise ValueError(f"store_kv_chunks(rotate=True) needs a power-of-two head_dim, got {d}")
    build()[1][(chunks.shape[0], h)](
        k, v, k_cache, v_cache, ks, vs, km, chunks, cu_seqlens_q, kv_lens, block_table, k_inv,
        v_inv, max_finite, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), ssp, ssh, block_table.stride(0),
        D=d, PAGE=page, PP=chunk_tokens(page), QUANT=quant, SCALED=scaled and not rows,
        ROWS=rows, HAS_KMEAN=has_mean, ROTATE=bool(rotate), LOG2D=d.bit_length() - 1,
        HSCALE=fwht_scale(d) if rotate else 1.0,
        num_warps=4 if d * chunk_tokens(page) >= 2048 else 2)
