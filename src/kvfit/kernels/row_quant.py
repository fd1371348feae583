"""int8 KV rows in Triton: one symmetric scale per (token, KV head), as the format contract says.

``quant_rows_i8(x)`` takes float32 rows ``x [R, C]`` (one row = one token's head, C >= head_dim
with zero padding) and returns ``(q int8 [R, C], scale float16 [R])`` with

    amax  = max |x|                                    (float32)
    scale = float16(min(max(amax / 127, 2**-14), 65504))   (IEEE division, round-to-nearest-even)
    q     = clamp(round_half_even(x / float32(scale)), -127, 127)

the same bytes as ``kvcache.quant.quantize_int8_rows`` (and ``tests/int8_reference.py``). The
65504 cap only matters for |x| > 8.3e6 (float16 would give an infinite scale, a NaN on
dequantization); a row holding a NaN gets the largest scale and its NaNs store 0, as there.
Owns nothing.
"""

from __future__ import annotations

import functools
import types

from kvfit.kernels.interpret import expose_for_interpreter, interpreting

# float16 scale bounds: the smallest normal (never zero, never subnormal) and the largest finite
SCALE_MIN = 2.0 ** -14
SCALE_MAX = 65504.0
INT8_MAX = 127.0


@functools.cache
def build() -> types.SimpleNamespace:
    """The jitted helpers ``round_half_even``, ``scale_i8`` (row amax -> float16 scale),
    ``apply_i8`` (rows / their scales -> int8), ``quant_rows_i8`` (both) and ``i8_to_f16`` (a
    packed conversion for the attention tiles; GPU only), compiled into callers."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_half_even(x):
        # exact round-to-nearest-even of float32 |x| < 2**22: adding 1.5 * 2**23 leaves no
        # fraction bits, the add rounds to even, the subtraction is exact (no libdevice call, so
        # the Triton interpreter runs it too)
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def scale_i8(amax):
        # float32 max |x| of rows [R] (NaN for a row holding one) -> their float16 scales [R]
        s = tl.math.div_rn(amax, 127.0)
        s = tl.minimum(tl.maximum(s, 6.103515625e-05), 65504.0)
        return tl.where(amax == amax, s, 65504.0).to(tl.float16)

    @triton.jit
    def apply_i8(x, s16):
        # float32 x [R, C] with the rows' float16 scales [R] -> int8 [R, C] (NaN -> 0)
        y = round_half_even(tl.math.div_rn(x, s16.to(tl.float32)[:, None]))
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return tl.where(x == x, y, 0.0).to(tl.int8)

    @triton.jit
    def row_amax(x):
        # max |x| of each row of x [R, C], NaN where the row holds a NaN (as torch's amax)
        nan_row = tl.max((x != x).to(tl.int32), axis=1) > 0
        return tl.where(nan_row, float("nan"), tl.max(tl.abs(x), axis=1))

    if interpreting():  # no inline asm under the interpreter: the same values by casts
        @triton.jit
        def i8_to_f16(x):
            return x.to(tl.float16)

        @triton.jit
        def i8_to_f16_biased(x):
            return (x.to(tl.float32) + 1152.0).to(tl.float16)
    else:
        @triton.jit
        def i8_to_f16(x):
            # int8 -> float16, four values per asm (no I2F, a quarter-rate unit on Hopper):
            # bias each byte by 128 (xor), place it under the float16 exponent of 1024 (prmt:
            # 0x64XX = 1024 + XX exactly), subtract 1152 = 1024 + 128 (two packed subtractions)
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 a, lo, hi, c;
                xor.b32 a, $2, 0x80808080;
                prmt.b32 lo, a, 0x64646464, 0x4140;
                prmt.b32 hi, a, 0x64646464, 0x4342;
                mov.b32 c, 0x64806480;
                sub.f16x2 $0, lo, c;
                sub.f16x2 $1, hi, c;
                }""",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)

        @triton.jit
        def i8_to_f16_biased(x):
            # int8 x -> float16 x + 1152, four values per asm (xor, two prmt): the caller takes
            # 1152 * sum(q) off Q.K^T and 1152 * sum(P) off P@V, no subtraction per value
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 a;
                xor.b32 a, $2, 0x80808080;
                prmt.b32 $0, a, 0x64646464, 0x4140;
                prmt.b32 $1, a, 0x64646464, 0x4342;
                }""",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)

    @triton.jit
    def max_nan(a, b):
        # elementwise max that keeps a NaN of either side (tl.maximum drops it)
        return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))

    @triton.jit
    def quant_rows_i8(x):
        # x float32 [R, C] -> (int8 [R, C], float16 scales [R]); padded columns must hold 0
        s16 = scale_i8(row_amax(x))
        return apply_i8(x, s16), s16

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(round_half_even=round_half_even, scale_i8=scale_i8,
                                 apply_i8=apply_i8, row_amax=row_amax, max_nan=max_nan,
                                 quant_rows_i8=quant_rows_i8,
                                 i8_to_f16=i8_to_f16, i8_to_f16_biased=i8_to_f16_biased)
