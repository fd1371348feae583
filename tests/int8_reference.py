"""torch reference of the int8 KV format (one symmetric float16 scale per (token, KV head)) for
the kernel tests: quantize rows, store into paged caches, gather back.

``kvcache.quant.quantize_int8_rows`` is the engine's version; this one divides by a tensor, so
it is the contract's IEEE division on CUDA too (torch's CUDA division by a Python scalar
multiplies by the float32 reciprocal, which can move a scale by one float16 step)."""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], float16 scales [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a full tensor divisor: torch's CUDA division by a Python scalar multiplies by its
    # float32 reciprocal, which is not the contract's IEEE division
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=2.0 ** -14, max=65504.0)
    scale = torch.nan_to_num(scale, nan=65504.0).to(torch.float16)  # a row holding a NaN
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp(-127, 127)
    return torch.nan_to_num(q, nan=0.0).to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def make_int8_caches(num_pages: int, hkv: int, page_size: int, d: int, device,
                     v_layout: str = "HND"):
    """(k_cache, v_cache, k_scales, v_scales) filled with random bytes (stale pages)."""
    g = torch.Generator(device="cpu").manual_seed(num_pages * 7 + d)
    kc = torch.randint(-127, 128, (num_pages, hkv, page_size, d), generator=g,
                       dtype=torch.int8).to(device)
    vshape = (num_pages, hkv, page_size, d) if v_layout == "HND" else (num_pages, hkv, d,
                                                                         page_size)
    vc = torch.randint(-127, 128, vshape, generator=g, dtype=torch.int8).to(device)
    ks = torch.full((num_pages, hkv, page_size), float("nan"), dtype=torch.float16,
                    device=device)
    vs = ks.clone()
    return kc, vc, ks, vs


def store_ref(k, v, kc, vc, ks, vs, slots, v_layout="HND", k_mean=None):
    """Reference slot-mapped store (mutates the caches); slots < 0 skipped."""
    live = slots >= 0
    k, v, slots = k[live], v[live], slots[live]
    if k_mean is not None:
        k = k.float() - k_mean
    p = kc.shape[2]
    page, off = slots // p, slots % p
    kq, kscale = quantize_rows(k)
    vq, vscale = quantize_rows(v)
    kc[page, :, off] = kq  # the indexed view is [T, H, D]
    if v_layout == "HND":
        vc[page, :, off] = vq
    else:
        vc[page, :, :, off] = vq
    ks[page, :, off] = kscale
    vs[page, :, off] = vscale


def gather_ref(kc, vc, ks, vs, pages, length, v_layout="HND"):
    """The first ``length`` tokens of a request on ``pages``, dequantized to float32
    ``[length, H, D]``."""
    k = kc[pages]  # [n, H, P, D]
    v = vc[pages] if v_layout == "HND" else vc[pages].transpose(2, 3)
    h, d = k.shape[1], k.shape[3]
    kf = dequantize_rows(k, ks[pages]).transpose(1, 2).reshape(-1, h, d)[:length]
    vf = dequantize_rows(v, vs[pages]).transpose(1, 2).reshape(-1, h, d)[:length]
    return kf, vf
