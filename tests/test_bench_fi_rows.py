"""bench/kernels_common.time_fi_into: FlashInfer's side of a ``kvfit bench kernels`` point."""

from __future__ import annotations

from types import SimpleNamespace

from kvfit.bench.kernels_common import time_fi_into


def test_fi_row_is_timed_refused_skipped_or_failed():
    on, off = SimpleNamespace(no_fi=False), SimpleNamespace(no_fi=True)
    rec: dict = {}
    time_fi_into(rec, on, None, lambda: 12.5)
    assert rec == {"fi_us": 12.5}
    rec = {}
    time_fi_into(rec, on, "FlashInfer reads no int8 KV pages", lambda: 1 / 0)
    assert rec == {"fi_error": "FlashInfer reads no int8 KV pages"}  # not timed
    rec = {}
    time_fi_into(rec, off, None, lambda: 1 / 0)
    assert rec == {}  # --no-fi: nothing at all

    def broken():
        raise RuntimeError("no kernel for sm_80")

    rec = {}
    time_fi_into(rec, on, None, broken)
    assert rec == {"fi_error": "RuntimeError: no kernel for sm_80"}
