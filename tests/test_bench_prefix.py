"""``kvfit bench prefix`` smoke on CPU with a tiny dummy-weight Llama: every workload runs with
caching on and off, hits are reported only with caching on, and the JSON carries the ratios."""

from __future__ import annotations

import json

from server_common import tiny_config


def test_bench_prefix_runs_and_reports(tmp_path, capsys):
    from kvfit.cli import main

    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", tiny_config(tmp_path), "--load-format", "dummy",
               "--device", "cpu", "--kv-dtypes", "fp8_e4m3", "--num-requests", "4",
               "--prefix-len", "32", "--suffix-len", "6", "--output-len", "3", "--num-chats", "2",
               "--turns", "2", "--turn-len", "5", "--random-requests", "3", "--random-min-len",
               "4", "--random-max-len", "12", "--probe-repeats", "1", "--capacity-max", "32",
               "--num-pages", "24", "--page-size", "4", "--max-model-len", "64",
               "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "probe cached" in text and "prefixes cached" in text and "targets:" in text
    res = json.loads(out.read_text())
    on, off = res["runs"]
    assert (on["caching"], off["caching"]) == ("on", "off")
    assert on["probe"]["cached_tokens"] == 32 and off["probe"]["cached_tokens"] == 0
    assert on["workloads"]["shared"]["hit_rate"] > 0
    assert on["workloads"]["multi-turn"]["hit_rate"] > 0
    assert all(w["hit_rate"] == 0 for w in off["workloads"].values())
    assert on["workloads"]["random"]["hit_rate"] == 0
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_queries"] == 0
    # 24 pages of 4 hold 3 prefixes of 8 pages; the probe sends 5 and the oldest are evicted
    assert on["capacity"]["bound"] == 3 and 1 <= on["capacity"]["prefixes_cached"] <= 3
    (ratios,) = res["ratios"]
    assert {"probe_ttft_cached_over_uncached", "shared_throughput_on_over_off",
            "random_throughput_on_over_off"} <= set(ratios)
