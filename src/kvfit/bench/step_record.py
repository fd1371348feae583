"""What the engine ran, step by step, for a roofline: decode/prefill tokens and KV lengths.

``StepRecorder.attach(engine)`` wraps the engine's ``scheduler.schedule`` (called once per step,
before the step runs), so it sees each step's batch on the host: no GPU sync, no change to the
step itself, a few microseconds of Python per request per step. ``detach`` restores it.

Per step it keeps ``decode_tokens`` (requests decoding one token), ``prefill_tokens``,
``kv_tokens`` (the KV entries the step's attention reads: each request's context after the step),
``decode_kv`` (the decoding requests' share of ``kv_tokens``), ``prefill_attn`` (sum over
prefill query tokens of their context length: the causal attention work) and ``sampled``
(rows that reach the LM head: decodes and last prompt chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """Columns, one entry per step (lists of ints)."""

    decode_tokens: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    decode_kv: list[int] = field(default_factory=list)
    prefill_attn: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.decode_tokens)

    def as_dict(self) -> dict:
        return {k: list(v) for k, v in self.__dict__.items()}


class StepRecorder:
    """Records every batch ``engine.scheduler.schedule()`` returns while attached."""

    def __init__(self):
        self.record = StepRecord()
        self._engine = None
        self._schedule = None

    def attach(self, engine) -> "StepRecorder":
        sched = engine.scheduler
        self._engine, self._schedule = engine, sched.schedule

        def recording_schedule(*args, **kwargs):
            batch = self._schedule(*args, **kwargs)
            self._observe(batch.items)
            return batch

        sched.schedule = recording_schedule
        return self

    def detach(self) -> None:
        if self._engine is not None:
            self._engine.scheduler.schedule = self._schedule
            self._engine = None

    def _observe(self, items) -> None:
        if not items:
            return
        dec = pre = kv = dec_kv = attn = sampled = 0
        for req, n in items:
            start = req.num_computed_tokens
            kv += start + n
            if start + n == req.num_tokens:
                sampled += 1
            if n == 1 and start >= req.num_prompt_tokens:
                dec += 1
                dec_kv += start + 1
            else:
                pre += n
                attn += n * start + n * (n + 1) // 2  # query j sees start + j keys
        r = self.record
        r.decode_tokens.append(dec)
        r.prefill_tokens.append(pre)
        r.kv_tokens.append(kv)
        r.decode_kv.append(dec_kv)
        r.prefill_attn.append(attn)
        r.sampled.append(sampled)
