"""The per-token ITL histogram renders what prometheus_client's Histogram renders for the same
observations (buckets, count; the sum up to rounding)."""

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from kvfit.server.metrics import _LATENCY_BUCKETS, TokenHistogram


def _samples(registry) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_matches_prometheus_histogram():
    ref_reg, reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("t_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=ref_reg)
    fast = TokenHistogram("t_seconds", "doc", _LATENCY_BUCKETS)
    reg.register(fast)
    rng = random.Random(1)
    for _ in range(3000):
        # values on the bucket bounds too (le: a bound belongs to its own bucket)
        v = rng.choice([rng.random() * 0.3, rng.choice(_LATENCY_BUCKETS), 0.0, 1e3])
        n = rng.randint(1, 4)
        for _ in range(n):
            ref.observe(v)
        fast.observe(v, n)
    want, got = _samples(ref_reg), _samples(reg)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
