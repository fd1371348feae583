"""Progress and time estimates for long benchmarks: which piece of work finished, elapsed time,
and the estimated time left.

``StageClock`` owns the list of stages still to run (a label, a kind, a size in units) and the
measured seconds per unit of each kind. After each stage the remaining stages are priced at the
measured rate of their kind (or, before a kind has run, at ``prior`` seconds per unit)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class Stage:
    label: str
    kind: str  # stages of one kind share a rate: "load", "prefill", "decode"
    units: float  # tokens (or 1 for a load)


def fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class StageClock:
    """Prints one progress line per finished stage (mutates its own measurements only)."""

    def __init__(self, stages: list[Stage], prior: dict[str, float], out=None):
        self.pending = list(stages)
        self.prior = dict(prior)  # seconds per unit before a kind is measured
        self.spent: dict[str, list[float]] = {}  # kind -> [seconds, units]
        self.t0 = time.monotonic()
        self.t_stage = self.t0
        self.out = out

    def rate(self, kind: str) -> float:
        s, u = self.spent.get(kind, (0.0, 0.0))
        return s / u if u else self.prior[kind]

    def remaining_seconds(self) -> float:
        return sum(st.units * self.rate(st.kind) for st in self.pending)

    def estimate_line(self) -> str:
        return f"estimated {fmt_seconds(self.remaining_seconds())} for {len(self.pending)} stages"

    def done(self, label: str, note: str = "") -> str:
        """Mark the next pending stage (whose label must be ``label``) finished; print and
        return its progress line."""
        now = time.monotonic()
        stage = self.pending.pop(0)
        assert stage.label == label, (stage.label, label)  # internal: stages run in plan order
        s = self.spent.setdefault(stage.kind, [0.0, 0.0])
        s[0] += now - self.t_stage
        s[1] += stage.units
        took, self.t_stage = now - self.t_stage, now
        elapsed, left = now - self.t0, self.remaining_seconds()
        line = (f"[{label}] done in {fmt_seconds(took)}{'; ' + note if note else ''} | elapsed "
                f"{fmt_seconds(elapsed)}, about {fmt_seconds(left)} left (total "
                f"~{fmt_seconds(elapsed + left)})")
        print(line, file=self.out or sys.stdout, flush=True)
        return line
