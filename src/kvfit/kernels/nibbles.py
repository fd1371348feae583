"""Packed 4-bit codes -> float16 values in registers (Triton helpers of the int4 decode).

A byte holds two codes (kvcache/kivi.py): the low nibble is the even channel, the high nibble
the odd one. ``dequant_lo(x, s, z)`` / ``dequant_hi(x, s, z)`` turn uint8 ``x`` and float16
scale/zero ``s``, ``z`` (broadcast to ``x``'s shape) into float16 ``code * s + z``:

* on the GPU, four bytes per inline asm without any int->float conversion instruction (I2F is a
  quarter-rate unit): ``prmt`` spreads two bytes into the two halves of a 32-bit register, one
  ``lop3`` keeps a nibble and ORs it under the float16 exponent of 1024 (``0x6400 | c`` is
  exactly 1024 + c), a packed ``sub.f16x2`` removes the 1024 (exact), a packed ``fma.rn.f16x2``
  applies scale and zero (one rounding to float16, as the float32 reference rounded to float16);
* under the Triton interpreter (no inline asm), the same values by casts.

Owns nothing.
"""

from __future__ import annotations

import functools
import types

from kvfit.kernels.interpret import expose_for_interpreter, interpreting


def nibble_asm(high: bool, scaled: bool) -> str:
    """PTX of four packed codes -> four float16 values (two f16x2 registers ``$0``, ``$1``) from
    the four bytes in ``$2``: ``prmt`` spreads two bytes into the halves of a register, the high
    nibbles are shifted down (``high``), ``lop3`` ORs the nibble under float16 1024's exponent and
    ``sub.f16x2`` takes the 1024 off (exact codes); ``scaled``: then ``code * s + z`` by one
    ``fma.rn.f16x2`` with the scales in ``$3``, ``$4`` and the zeros in ``$5``, ``$6``."""
    out = ("a", "b") if scaled else ("$0", "$1")
    lines = [".reg .b32 a, b, c, m;", "mov.b32 c, 0x64006400;", "mov.b32 m, 0x000f000f;",
             "prmt.b32 a, $2, 0, 0x4140;", "prmt.b32 b, $2, 0, 0x4342;"]
    if high:
        lines += ["shr.b32 a, a, 4;", "shr.b32 b, b, 4;"]
    lines += ["lop3.b32 a, a, m, c, 0xea;", "lop3.b32 b, b, m, c, 0xea;",
              f"sub.f16x2 {out[0]}, a, c;", f"sub.f16x2 {out[1]}, b, c;"]
    if scaled:
        lines += ["fma.rn.f16x2 $0, a, $3, $5;", "fma.rn.f16x2 $1, b, $4, $6;"]
    return "{\n" + "".join(line + "\n" for line in lines) + "}\n"


@functools.cache
def build() -> types.SimpleNamespace:
    """``dequant_lo``, ``dequant_hi`` (float16, asm on the GPU), ``dequant_cast(x, s, z, HI,
    DTYPE)`` (casts, any dtype), and the same without scale and zero (``codes_lo``,
    ``codes_hi``, ``codes_cast``: the codes 0..15 exactly), compiled into callers."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # jit signatures name tl.constexpr

    @triton.jit
    def dequant_cast(x, s, z, HI: tl.constexpr, DTYPE: tl.constexpr):
        # (nibble of x) * s + z in float32, rounded to DTYPE
        c = (x >> 4) if HI else (x & 15)
        return (c.to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)).to(DTYPE)

    @triton.jit
    def codes_cast(x, HI: tl.constexpr, DTYPE: tl.constexpr):
        # the nibble of x as DTYPE (exact: 0..15)
        c = (x >> 4) if HI else (x & 15)
        return c.to(DTYPE)

    if interpreting():
        @triton.jit
        def codes_lo(x):
            return codes_cast(x, False, tl.float16)

        @triton.jit
        def codes_hi(x):
            return codes_cast(x, True, tl.float16)

        @triton.jit
        def dequant_lo(x, s, z):
            return dequant_cast(x, s, z, False, tl.float16)

        @triton.jit
        def dequant_hi(x, s, z):
            return dequant_cast(x, s, z, True, tl.float16)
    else:
        codes_lo_asm = tl.constexpr(nibble_asm(high=False, scaled=False))
        codes_hi_asm = tl.constexpr(nibble_asm(high=True, scaled=False))
        dequant_lo_asm = tl.constexpr(nibble_asm(high=False, scaled=True))
        dequant_hi_asm = tl.constexpr(nibble_asm(high=True, scaled=True))

        @triton.jit
        def codes_lo(x):
            # four low nibbles -> float16 codes, exact (as dequant_lo without scale and zero)
            return tl.inline_asm_elementwise(codes_lo_asm, "=r,=r,r", [x], dtype=tl.float16,
                                             is_pure=True, pack=4)

        @triton.jit
        def codes_hi(x):
            # four high nibbles -> float16 codes, exact
            return tl.inline_asm_elementwise(codes_hi_asm, "=r,=r,r", [x], dtype=tl.float16,
                                             is_pure=True, pack=4)

        @triton.jit
        def dequant_lo(x, s, z):
            # $0, $1: four float16 results; $2: four packed bytes; $3, $4 the scales, $5, $6
            # the zeros
            return tl.inline_asm_elementwise(dequant_lo_asm, "=r,=r,r,r,r,r,r", [x, s, z],
                                             dtype=tl.float16, is_pure=True, pack=4)

        @triton.jit
        def dequant_hi(x, s, z):
            # as dequant_lo, the high nibbles shifted down first
            return tl.inline_asm_elementwise(dequant_hi_asm, "=r,=r,r,r,r,r,r", [x, s, z],
                                             dtype=tl.float16, is_pure=True, pack=4)

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(dequant_lo=dequant_lo, dequant_hi=dequant_hi,
                                 dequant_cast=dequant_cast, codes_lo=codes_lo, codes_hi=codes_hi,
                                 codes_cast=codes_cast)
