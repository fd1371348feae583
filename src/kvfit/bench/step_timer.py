"""Wall time of every engine step, for comparing the server's engine process with offline runs.

``StepTimer.attach(engine)`` wraps ``engine.step`` (and ``engine.scheduler.schedule``, to see the
batch): per step it keeps the start time, the seconds ``step`` took, the decode rows, the prefill
tokens, and the running / waiting counts after scheduling. No GPU sync is added; with overlap
scheduling a step's time is host work plus the wait for the previous step's ids.

``timed_engine(config, path)`` builds an ``LLMEngine`` with a timer attached that writes its
records (JSON) to ``path`` whenever the engine runs out of work, so a server's engine process
(``kvfit bench serve --step-log``) leaves its log without a shutdown hook. ``summarize`` turns a
record into the few numbers that say where a run's time went.
"""

from __future__ import annotations

import json
import time
from typing import Optional


class StepTimer:
    """Records every step of one engine while attached (mutates the engine's ``step`` and its
    scheduler's ``schedule`` attributes; ``detach`` restores them)."""

    def __init__(self, path: Optional[str] = None):
        self.path = path
        # (t_start, seconds, decode, prefill_tokens, running, waiting, idle_after)
        self.rows: list[tuple] = []
        self._engine = None
        self._batch: Optional[tuple[int, int, int, int]] = None

    def attach(self, engine) -> "StepTimer":
        self._engine = engine
        sched = engine.scheduler
        step, schedule = engine.step, sched.schedule

        def timed_schedule(*a, **k):
            batch = schedule(*a, **k)
            dec = pre = 0
            for req, n in batch.items:
                if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                    dec += 1
                else:
                    pre += n
            self._batch = (dec, pre, len(sched.running), len(sched.waiting))
            return batch

        def timed_step(*args, **kwargs):
            t0 = time.perf_counter()
            self._batch = None
            out = step(*args, **kwargs)
            dt = time.perf_counter() - t0
            idle = not engine.has_unfinished_requests()
            self.rows.append((t0, dt) + (self._batch or (0, 0, 0, 0)) + (int(idle),))
            if self.path is not None and idle:
                self.dump()
            return out

        engine.step, sched.schedule = timed_step, timed_schedule
        return self

    def detach(self) -> None:
        if self._engine is not None:
            del self._engine.step  # the instance attribute; the class method shows again
            del self._engine.scheduler.schedule
            self._engine = None

    def dump(self, path: Optional[str] = None) -> None:
        with open(path or self.path, "w") as f:
            json.dump({"columns": ["t_start", "seconds", "decode", "prefill_tokens", "running",
                                   "waiting", "idle_after"], "rows": self.rows}, f)


def timed_engine(config, path: str):
    """An ``LLMEngine`` for ``config`` whose steps are logged to ``path`` (picklable as a
    ``functools.partial``: the server's engine process builds it)."""
    from kvfit.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    StepTimer(path).attach(engine)
    return engine


def after_first_idle(rows: list) -> list:
    """The rows after the engine first ran out of work (a run after its warm-up request)."""
    for i, r in enumerate(rows):
        if r[6]:
            return rows[i + 1:]
    return rows


def summarize(rows: list) -> dict:
    """Steps, busy and idle seconds, decode rows per step and prefill tokens of a record."""
    if not rows:
        return {"steps": 0}
    span = rows[-1][0] + rows[-1][1] - rows[0][0]
    busy = sum(r[1] for r in rows)
    dec = [r[2] for r in rows]
    decode_only = [r[1] for r in rows if r[3] == 0 and r[2] > 0]
    decode_only.sort()
    return {"steps": len(rows), "span_s": span, "busy_s": busy, "idle_s": span - busy,
            "decode_rows": sum(dec), "mean_decode_rows": sum(dec) / len(rows),
            "prefill_tokens": sum(r[3] for r in rows),
            "steps_with_prefill": sum(1 for r in rows if r[3] > 0),
            "decode_step_median_ms": 1e3 * decode_only[len(decode_only) // 2]
            if decode_only else 0.0,
            "steps_below_full": sum(1 for r in rows if r[4] < max(x[4] for x in rows))}
