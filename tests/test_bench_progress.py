"""The long-benchmark clock (issue 19): progress lines with elapsed and estimated time left,
the estimate priced at each stage kind's measured rate."""

from __future__ import annotations

import io

import pytest

from kvfit.bench import progress
from kvfit.bench.progress import Stage, StageClock, fmt_seconds


def test_estimate_uses_measured_rate_per_kind(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stages = [Stage("a: load", "load", 1), Stage("a: passkey", "prefill", 1000),
              Stage("a: agreement", "decode", 100), Stage("b: load", "load", 1),
              Stage("b: passkey", "prefill", 3000)]
    out = io.StringIO()
    clock = StageClock(stages, {"load": 5.0, "prefill": 0.01, "decode": 0.5}, out)
    # before anything ran: priors only
    assert clock.remaining_seconds() == pytest.approx(5 + 10 + 50 + 5 + 30)
    now[0] += 8.0
    clock.done("a: load")  # load measured at 8 s
    assert clock.remaining_seconds() == pytest.approx(10 + 50 + 8 + 30)
    now[0] += 20.0
    line = clock.done("a: passkey", "1/1 found")  # prefill measured at 0.02 s/token
    assert clock.remaining_seconds() == pytest.approx(50 + 8 + 60)
    assert line.startswith("[a: passkey] done in 20 s; 1/1 found | elapsed 28 s")
    assert "about 2.0 min left (total ~2.4 min)" in line and line in out.getvalue()
    with pytest.raises(AssertionError):
        clock.done("b: load")  # stages finish in plan order


def test_fmt_seconds():
    assert fmt_seconds(42) == "42 s"
    assert fmt_seconds(600) == "10.0 min"
    assert fmt_seconds(3 * 3600) == "3.0 h"


def test_quality_plan_sizes_stages():
    import argparse

    from kvfit.bench.quality import PROMPTS, plan_stages

    args = argparse.Namespace(depths=[0.1, 0.9], keys=2, context=1000, needle_only=False,
                              agree_tokens=16, kl_tokens=512)
    st = plan_stages(args, ["bfloat16", "fp8_e4m3"])
    assert [s.label for s in st[:5]] == ["bfloat16: load", "bfloat16: passkey @10%",
                                         "bfloat16: passkey @90%", "bfloat16: agreement",
                                         "bfloat16: KL + perplexity"]
    assert len(st) == 10 and st[1].units == 2000 and st[3].units == len(PROMPTS) * 16
