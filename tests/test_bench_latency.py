"""``kvfit bench latency`` on the CPU with a tiny dummy model: every iteration produces the
asked tokens, its TTFT and decode split add up to its latency, the decode-only roofline counts
only decode steps, percentiles match numpy's default method, and bad flags are clear errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from server_common import tiny_config

from kvfit.bench.latency import decode_roofline_s, main, percentiles
from kvfit.bench.step_record import StepRecord
from kvfit.bench.throughput import roofline

TINY = ["--load-format", "dummy", "--device", "cpu", "--num-pages", "64", "--max-model-len",
        "512"]


def test_percentiles_match_numpys_linear_method():
    rng = random.Random()
    for n in (1, 2, 7, 30):
        xs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        got = percentiles(xs)
        want = np.percentile(np.array(xs), list(got))
        assert list(got.values()) == pytest.approx(list(want), rel=1e-12)


def test_decode_roofline_counts_only_decode_steps():
    rec = StepRecord(decode_tokens=[0, 2, 2, 1], prefill_tokens=[40, 0, 8, 0],
                     kv_tokens=[40, 42, 52, 45], decode_kv=[0, 42, 44, 45],
                     prefill_attn=[820, 0, 68, 0], sampled=[2, 2, 3, 1])
    costs = {"weight_bytes": 1000, "kv_bytes_per_token": 10, "linear_params": 100,
             "lm_head_params": 50, "attn_flops_per_pair": 8}
    ceil = {"copy_bytes_per_s": 100.0, "matmul_flops_per_s": 1000.0}
    only = StepRecord(decode_tokens=[2, 1], prefill_tokens=[0, 0], kv_tokens=[42, 45],
                      decode_kv=[42, 45], prefill_attn=[0, 0], sampled=[2, 1])
    want = roofline(only, costs, ceil)["time_s"]
    assert decode_roofline_s(rec, costs, ceil) == pytest.approx(want)
    assert want < roofline(rec, costs, ceil)["time_s"]


def test_cpu_run_reports_every_iteration(tmp_path, capsys):
    out = tmp_path / "lat.json"
    batch, in_len, out_len, iters = 3, 24, 6, 4
    rc = main(["--model", tiny_config(tmp_path), *TINY, "--batch-size", str(batch),
               "--input-len", str(in_len), "--output-len", str(out_len), "--num-iters-warmup",
               "1", "--num-iters", str(iters), "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == len(r["iterations"]) == iters
    for it in r["iterations"]:
        assert it["output_tokens"] == batch * out_len
        assert it["decode_tokens"] == batch * (out_len - 1)
        assert 0 < it["ttft_s"] < it["latency_s"]
        assert it["ttft_s"] + it["decode_s"] == pytest.approx(it["latency_s"])
        assert it["num_steps"] >= out_len  # at least a prefill step and out_len - 1 decodes
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / iters)
    assert min(r["latencies"]) <= r["percentiles"]["50"] <= max(r["latencies"])
    assert r["decode_tok_s"] > 0 and "roofline_fraction" not in r  # no roofline on the CPU
    text = capsys.readouterr().out
    assert "Avg latency:" in text and "99% percentile latency:" in text


def test_bad_flags_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_config(tmp_path), *TINY, "--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_config(tmp_path), *TINY, "--input-len", "500", "--output-len",
              "100", "--num-iters-warmup", "0", "--num-iters", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "exceeds the context of 512 tokens" in err


def test_the_engine_is_built_for_the_batch(tmp_path, monkeypatch):
    """max_num_seqs is capped at --batch-size (never more requests at once): at batch 1 the
    engine resolves --decode-gemv auto as it does for `kvfit generate` with one prompt; an
    explicit smaller --max-num-seqs is kept."""
    from kvfit import llm as llm_mod

    seen = []
    real = llm_mod.LLM.__init__

    def spy(self, *a, **kw):
        seen.append(kw["max_num_seqs"])
        real(self, *a, **kw)

    monkeypatch.setattr(llm_mod.LLM, "__init__", spy)
    base = ["--model", tiny_config(tmp_path), *TINY, "--input-len", "8", "--output-len", "3",
            "--num-iters-warmup", "0", "--num-iters", "1", "--output-json",
            str(tmp_path / "l.json")]
    assert main([*base, "--batch-size", "1"]) == 0
    assert main([*base, "--batch-size", "3", "--max-num-seqs", "2"]) == 0
    assert seen == [1, 2]

