"""benchmarks/kernels/sass_scoreboards.py: sm_90 control bits decoded from a cuobjdump listing."""

import random

from bench_scripts import kernel_script


def _tool():
    return kernel_script("sass_scoreboards")


def _listing(rows):
    # cuobjdump's layout: the instruction with its first encoding word, the second word below
    out = ["        Function : _k"]
    for addr, text, ctrl in rows:
        lo, hi = random.getrandbits(64), (ctrl << 41) | random.getrandbits(41)
        out.append(f"        /*{addr:04x}*/                   {text} ;   /* 0x{lo:016x} */")
        out.append(f"                                                  /* 0x{hi:016x} */")
    return out


def _ctrl(stall, yld, wb, rb, wait, reuse):
    mask = sum(1 << j for j in wait)
    return stall | yld << 4 | wb << 5 | rb << 8 | mask << 11 | reuse << 17


def test_control_bits_and_main_loop_decoded():
    rng = random.Random()
    fields = [(rng.randrange(16), rng.randrange(2), rng.randrange(8), rng.randrange(8),
               tuple(sorted(rng.sample(range(6), rng.randrange(4)))), rng.randrange(16))
              for _ in range(5)]
    texts = ["LDC R1, c[0x0][0x28]", "LDG.E.128 R8, desc[UR4][R2.64]",
             "F2FP.F16.E4M3.UNPACK_B R12, R8", "@P0 BRA 0x10", "EXIT"]
    rows = [(16 * i, t, _ctrl(*f)) for i, (t, f) in enumerate(zip(texts, fields))]
    tool = _tool()
    ins = tool.parse(_listing(rows))
    assert [x.text for x in ins] == texts
    for x, (stall, yld, wb, rb, wait, reuse) in zip(ins, fields):
        assert (x.stall, x.yield_, x.wait, x.reuse) == (stall, bool(yld), wait, reuse)
        assert x.wb == (None if wb == 7 else wb) and x.rb == (None if rb == 7 else rb)
    # the loop: from the branch target 0x10 to the branch at 0x30
    assert [x.addr for x in tool.main_loop(ins)] == [0x10, 0x20, 0x30]
