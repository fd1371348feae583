"""Warm the GPU's L2 cache with bytes a later kernel of the step will read, while the kernels in
between leave HBM idle.

At batch 1 a decoder layer's attention (RoPE + K/V store, the split decode and its merge) reads
a few MB in ~10 us: the HBM is idle for most of it, and the next kernels (the output and gate/up
GEMVs) then start cold. ``prefetch_l2(ranges)`` launches one small kernel whose threads each
issue one Hopper bulk prefetch (``cp.async.bulk.prefetch.L2.global``: fire and forget, no
registers, no completion to wait for) over a slice of the given byte ranges; the kernel ends
at once and the copies into L2 run on while the following kernels execute. Nothing is written:
a prefetch changes where bytes are read from, never what a kernel computes.

Owns nothing, mutates nothing. ``supports(device)``: CUDA with compute capability >= 9.0 (the
bulk prefetch is sm_90+). Ranges are ``(tensor, first_byte, n_bytes)``; addresses and sizes are
rounded to the 16 bytes the instruction wants (inward: a prefetch never leaves its tensor).
"""

from __future__ import annotations

import functools

import torch

CHUNK = 4096  # bytes per thread and prefetch instruction
BLOCK = 128  # threads per program
MAX_RANGES = 3


@functools.cache
def build():
    """The jitted prefetch kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch(P0, N0, P1, N1, P2, N2, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # lane i of program p prefetches bytes [(p * BLOCK + i) * CHUNK, + CHUNK) of each range
        # (the last slice of a range shorter); P* are byte pointers 16-byte aligned, N* multiples
        # of 16
        offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK  # [BLOCK]
        for r in tl.static_range(3):
            if r == 0:
                base, n = P0, N0
            elif r == 1:
                base, n = P1, N1
            else:
                base, n = P2, N2
            size = tl.minimum(n - offs, CHUNK).to(tl.int32)  # <= 0: nothing to fetch
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)

    return _prefetch


def supports(device: torch.device) -> bool:
    """True where the bulk L2 prefetch exists: CUDA devices of compute capability 9.0 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def prefetch_l2(ranges: list[tuple[torch.Tensor, int, int]]) -> None:
    """Start copying up to ``MAX_RANGES`` byte ranges ``(tensor, first_byte, n_bytes)`` of CUDA
    tensors into L2 and return (one launch; no effect on any value). Ranges are clipped to their
    tensor; empty ones are skipped."""
    import triton

    if len(ranges) > MAX_RANGES:
        raise ValueError(f"prefetch_l2 takes at most {MAX_RANGES} ranges, got {len(ranges)}")
    args = []
    longest = 0
    for t, first, n in ranges:
        total = t.numel() * t.element_size()
        start = min(max(0, int(first)), total)
        ptr = t.data_ptr() + start
        pad = (-ptr) % 16  # round the start up and the length down to 16 bytes
        n = max(0, (min(int(n), total - start) - pad) // 16 * 16)
        if n:
            flat = t.detach().reshape(-1).view(torch.int8)  # [total] the tensor's bytes
            args += [flat[start + pad:start + pad + n], n]
            longest = max(longest, n)
    if not longest:
        return
    while len(args) < 2 * MAX_RANGES:
        args += [args[0], 0]
    grid = (triton.cdiv(longest, BLOCK * CHUNK),)
    build()[grid](*args, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=BLOCK // 32)
