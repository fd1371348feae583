"""The KIVI-style 4-bit quantizer of the int4 KV pool (torch reference; kernels store the same bytes).

K is quantized per channel over the 32 tokens of a page, V per token in groups of 32 channels;
both asymmetric with a float16 scale and zero point:

    scale = float16(max((max - min) / 15, 2**-14))      (never zero, never subnormal)
    zero  = float16(min)
    q     = clamp(round_half_even((x - zero) / scale), 0, 15)      (float32 arithmetic)
    x'    = q * scale + zero

Beyond the contract's formula, scale and zero are clamped to float16's finite range so that any
finite input gives finite scales (a range wider than 65504 saturates instead of storing Inf).

Codes are packed two per byte, the even channel in the low nibble: ``byte = q[2i] | q[2i+1] << 4``.
Token-minor V pages (the pool's ``v_layout`` "HDN", ``v_token_minor``) pack two tokens of a channel
instead, the even token in the low nibble, and keep V's scales and zeros per group, then token.
"""

from __future__ import annotations

import torch

GROUP = 32  # tokens per K group (= the int4 pool's page size) and channels per V group
MIN_SCALE = 2.0 ** -14  # float16's smallest normal number
F16_MAX = float(torch.finfo(torch.float16).max)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., D]`` -> packed bytes ``[..., D/2]`` (low nibble = even channel)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., D/2]`` -> uint8 codes ``[..., D]`` (inverse of ``pack_nibbles``)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., D/2, 2] -> [..., D]


def v_token_minor(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Token-major V pages -> token-minor ones (the same codes, scales and zeros reordered):
    packed ``[..., P, D/2]`` (a byte: two channels of a token) -> ``[..., D, P/2]`` (a byte: two
    tokens of a channel, the even token in the low nibble); scale, zero ``[..., P, D/32]`` ->
    ``[..., D/32, P]``."""
    codes = unpack_nibbles(packed).transpose(-1, -2)  # [..., P, D] -> [..., D, P]
    return pack_nibbles(codes), scale.transpose(-1, -2), zero.transpose(-1, -2)


def v_token_major(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Inverse of ``v_token_minor``: the same transposition (of tokens and channels) undoes
    itself."""
    return v_token_minor(packed, scale, zero)


def evens_first(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` in channel order -> the even channels, then the odd ones (the int4 pool's
    order of K's per-channel scale and zero: a nibble half's values are contiguous)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def channel_order(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``evens_first``."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)  # [..., D/2, 2]


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 scale and zero of groups with float32 minimum ``lo`` and maximum ``hi``."""
    # a tensor divisor: torch divides by a Python scalar on CUDA as a multiply by its reciprocal,
    # which is not the IEEE quotient the kernels (div_rn) and the CPU compute
    scale = ((hi - lo) / hi.new_full((), 15.0)).clamp(MIN_SCALE, F16_MAX).to(torch.float16)
    zero = lo.clamp(-F16_MAX, F16_MAX).to(torch.float16)
    return scale, zero


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """clamp(round((x - zero) / scale), 0, 15) in float32, as uint8 (scale/zero broadcast)."""
    q = torch.round((x - zero.float()) / scale.float())  # round half to even
    return q.clamp_(0, 15).to(torch.uint8)


def quantize_k_page(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One page of K, ``[..., P, D]`` (any float dtype), per channel over its P tokens.

    Returns packed ``[..., P, D/2]`` uint8, scale and zero ``[..., D]`` float16.
    """
    x = k.float()
    scale, zero = _scale_zero(x.amin(dim=-2), x.amax(dim=-2))  # [..., D]
    q = _codes(x, scale.unsqueeze(-2), zero.unsqueeze(-2))
    return pack_nibbles(q), scale, zero


def quantize_v_tokens(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V rows ``[..., D]`` per token in groups of 32 channels.

    Returns packed ``[..., D/2]`` uint8, scale and zero ``[..., D/32]`` float16.
    """
    d = v.shape[-1]
    x = v.float().unflatten(-1, (d // GROUP, GROUP))  # [..., D] -> [..., D/32, 32]
    scale, zero = _scale_zero(x.amin(dim=-1), x.amax(dim=-1))  # [..., D/32]
    q = _codes(x, scale.unsqueeze(-1), zero.unsqueeze(-1)).flatten(-2)  # [..., D]
    return pack_nibbles(q), scale, zero


def dequantize_k_page(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Packed K ``[..., P, D/2]`` with scale/zero ``[..., D]`` -> ``[..., P, D]`` in ``dtype``."""
    q = unpack_nibbles(packed).float()
    return (q * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).to(dtype)


def dequantize_v_tokens(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """Packed V ``[..., D/2]`` with scale/zero ``[..., D/32]`` -> ``[..., D]`` in ``dtype``."""
    q = unpack_nibbles(packed).float()
    q = q.unflatten(-1, (q.shape[-1] // GROUP, GROUP))  # [..., D/32, 32]
    x = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)
