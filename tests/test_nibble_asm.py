"""The int4 decode's inline PTX (kernels/nibbles.nibble_asm) executed by a small emulator of its
seven instructions on random bytes, scales and zeros: the codes come out exact and the scaled
values as ``code * s + z`` rounded once to float16, element i from byte i (Triton's pack=4
order). On the GPU the kernels' tests check the same text through the int4 decode."""

import numpy as np
import pytest

from kvfit.kernels.nibbles import nibble_asm


def _halves(r: int) -> np.ndarray:
    return np.array([r & 0xFFFF, r >> 16], dtype=np.uint16).view(np.float16)


def _word(h: np.ndarray) -> int:
    lo, hi = np.asarray(h, dtype=np.float16).view(np.uint16)
    return int(lo) | (int(hi) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a | (b << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def run_asm(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Execute ``text`` (the subset of PTX nibble_asm writes) over 32-bit registers ``regs``."""
    body = text.strip()
    assert body.startswith("{") and body.endswith("}")
    for line in body[1:-1].strip().splitlines():
        op, args = line.rstrip(";").split(None, 1)
        a = [x.strip() for x in args.split(",")]
        val = (lambda x: regs[x] if x in regs else int(x, 0))
        if op == ".reg":
            continue
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "lop3.b32" and a[4] == "0xea":  # (a & b) | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "sub.f16x2":
            regs[a[0]] = _word(_halves(val(a[1])) - _halves(val(a[2])))
        elif op == "fma.rn.f16x2":  # one rounding: the f16 product is exact in float64
            x, y, z = (_halves(val(r)).astype(np.float64) for r in a[1:])
            regs[a[0]] = _word((x * y + z).astype(np.float16))
        else:
            raise AssertionError(f"the emulator does not know {line!r}")
    return regs


@pytest.mark.parametrize("high", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_nibble_asm_matches_the_reference(high, scaled):
    rng = np.random.default_rng(int(high) * 2 + int(scaled))
    for _ in range(200):
        x = rng.integers(0, 256, 4, dtype=np.uint8)
        s = (rng.random(4) * 0.2 + 1e-3).astype(np.float16)
        z = (rng.standard_normal(4) * 3).astype(np.float16)
        regs = {"$2": int.from_bytes(x.tobytes(), "little"), "$3": _word(s[:2]),
                "$4": _word(s[2:]), "$5": _word(z[:2]), "$6": _word(z[2:])}
        regs["$0"] = regs["$1"] = 0xDEADBEEF  # poisoned outputs
        out = run_asm(nibble_asm(high=high, scaled=scaled), regs)
        got = np.concatenate([_halves(out["$0"]), _halves(out["$1"])])
        codes = ((x >> 4) if high else (x & 15)).astype(np.float64)
        want = (codes * s.astype(np.float64) + z).astype(np.float16) if scaled else \
            codes.astype(np.float16)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_emulator_rejects_what_it_does_not_know():
    with pytest.raises(AssertionError, match="does not know"):
        run_asm("{\nadd.u32 $0, $2, 1;\n}\n", {"$2": 1})
