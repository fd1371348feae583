"""The scheduling control bits of sm_90 SASS, per instruction of a kernel's main loop: stall
cycles, yield, the scoreboard a variable-latency instruction sets on writing (``wb``) and on
reading its sources (``rb``), and the scoreboards it waits for (``wait``). Which loads share a
scoreboard decides how early their first consumer may run: a consumer waits for every load of
the scoreboard it names.

    cuobjdump -sass kernel.cubin > k.sass
    python3 benchmarks/kernels/sass_scoreboards.py k.sass [REGEX]   (default: loads, converts,
                                                                  MMAs, barriers, shuffles)

Bit positions (of the 128-bit instruction, counted from bit 0 of the first 64-bit word): stall
105-108, yield 109, write scoreboard 110-112, read scoreboard 113-115, wait mask 116-121, reuse
122-125 (7 in a scoreboard field: none), as the published dissections of Volta to Hopper
encodings give them. cuobjdump prints the first word beside the instruction and the second on
the next line.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

_INST = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s+/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"\s+/\* (0x[0-9a-f]+) \*/\s*$")


class Inst(NamedTuple):
    addr: int
    text: str
    stall: int
    yield_: bool
    wb: int | None  # scoreboard set when the result is written
    rb: int | None  # scoreboard set when the sources are read
    wait: tuple[int, ...]  # scoreboards waited for before issue
    reuse: int


def decode(addr: int, text: str, hi: int) -> Inst:
    """One instruction from its text and the second 64-bit word of its encoding."""
    ctrl = hi >> (105 - 64)
    wb, rb = (ctrl >> 5) & 7, (ctrl >> 8) & 7
    wait = tuple(j for j in range(6) if (ctrl >> 11) >> j & 1)
    return Inst(addr, text, ctrl & 0xF, bool((ctrl >> 4) & 1), None if wb == 7 else wb,
                None if rb == 7 else rb, wait, (ctrl >> 17) & 0xF)


def parse(lines: list[str]) -> list[Inst]:
    """The instructions of a ``cuobjdump -sass`` listing, in address order."""
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _INST.match(line)
        m2 = _WORD.match(lines[i + 1]) if m else None
        if m2:
            out.append(decode(int(m.group(1), 16), m.group(2), int(m2.group(1), 16)))
    return out


def main_loop(ins: list[Inst]) -> list[Inst]:
    """The instructions under the longest backward branch (a kernel's main loop)."""
    best = (0, 0, -1)
    for x in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", x.text)
        if m:
            tgt = int(m.group(1), 16)
            if tgt < x.addr and x.addr - tgt > best[0]:
                best = (x.addr - tgt, tgt, x.addr)
    return [x for x in ins if best[1] <= x.addr <= best[2]]


def main() -> None:
    path = sys.argv[1]
    want = re.compile(sys.argv[2] if len(sys.argv) > 2 else r"LDG|F2FP|HGMMA|BAR|SHFL|LDS|STS")
    with open(path) as f:
        loop = main_loop(parse(f.read().splitlines()))
    print("| # | instruction | stall | sets (write / read) | waits for |")
    print("|---:|---|---:|---|---|")
    for k, x in enumerate(loop):
        if want.search(x.text):
            sets = f"{'-' if x.wb is None else x.wb} / {'-' if x.rb is None else x.rb}"
            print(f"| {k} | `{x.text[:64]}` | {x.stall} | {sets} | "
                  f"{','.join(map(str, x.wait)) or '-'} |")


if __name__ == "__main__":
    main()
