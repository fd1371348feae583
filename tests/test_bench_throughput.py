"""``kvfit bench throughput`` on the CPU with a tiny dummy model: the workload draws, the step
record (every scheduled token accounted for), the roofline arithmetic, JSON and PNG output; and
``kvfit bench serve --offline`` (server and offline runs of the same requests)."""

from __future__ import annotations

import json
import random

import pytest
from server_common import tiny_config

from kvfit.bench.step_record import StepRecord
from kvfit.bench.throughput import main, make_workload, roofline

TINY = ["--load-format", "dummy", "--device", "cpu", "--num-pages", "64", "--max-model-len",
        "512"]


def test_default_workload_is_nano_vllms_draws():
    prompts, outs = make_workload(256, None, None, (0, 10000), seed=0)
    # nano-vllm bench.py, verbatim draws: seed(0); prompts first, then max_tokens
    random.seed(0)
    ref_prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                   for _ in range(256)]
    ref_outs = [random.randint(100, 1024) for _ in range(256)]
    assert prompts == ref_prompts and outs == ref_outs
    fixed, fixed_outs = make_workload(5, 7, 3, (1, 9), seed=4)
    assert [len(p) for p in fixed] == [7] * 5 and fixed_outs == [3] * 5
    assert all(1 <= t <= 9 for p in fixed for t in p)


def test_cpu_smoke_records_every_scheduled_token(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    n, in_len, out_len = 6, 40, 9
    rc = main(["--model", tiny_config(tmp_path), *TINY, "--max-num-batched-tokens", "64",
               "--warmup-prompts", "2", "--num-prompts", str(n), "--input-len", str(in_len), "--output-len",
               str(out_len), "--token-id-range", "1", "250", "--output-json", str(out),
               "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["output_tokens"] == n * out_len and r["input_tokens"] == n * in_len
    assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
    s = r["steps"]
    assert len(s["decode_tokens"]) == r["num_steps"] > 0
    # without preemption every token but each request's last one is fed through a step once
    assert r["num_preemptions"] == 0
    assert sum(s["decode_tokens"]) + sum(s["prefill_tokens"]) == n * (in_len + out_len - 1)
    assert sum(s["sampled"]) == n * out_len
    assert max(s["prefill_tokens"]) <= 64  # chunked by the token budget
    assert "roofline_fraction" not in r  # skipped on the CPU
    assert png.stat().st_size > 0


def test_roofline_sums_max_of_memory_and_compute():
    rec = StepRecord(decode_tokens=[0, 4], prefill_tokens=[10, 0], kv_tokens=[10, 44],
                     decode_kv=[0, 44], prefill_attn=[55, 0], sampled=[1, 4])
    costs = {"weight_bytes": 1000, "kv_bytes_per_token": 10, "linear_params": 100,
             "lm_head_params": 50, "attn_flops_per_pair": 8}
    roof = roofline(rec, costs, {"copy_bytes_per_s": 100.0, "matmul_flops_per_s": 1000.0})
    mem = [(1000 + 100) / 100, (1000 + 440) / 100]
    comp = [(2 * 100 * 10 + 2 * 50 + 8 * 55) / 1000, (2 * 100 * 4 + 2 * 50 * 4 + 8 * 44) / 1000]
    assert roof["step_memory_s"] == pytest.approx(mem)
    assert roof["step_compute_s"] == pytest.approx(comp)
    assert roof["time_s"] == pytest.approx(sum(max(m, c) for m, c in zip(mem, comp)))
    assert roof["memory_bound_steps"] == 2


def test_bad_flags_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_config(tmp_path), *TINY, "--num-prompts", "0"])
    assert e.value.code == 2 and "--num-prompts must be >= 1" in capsys.readouterr().err


def test_bench_serve_offline_ratio(tmp_path, capsys):
    """Server (its own process, the engine in another) then the same requests offline."""
    from kvfit.bench.serve import main as serve_main

    out = tmp_path / "serve.json"
    rc = serve_main(["--model", tiny_config(tmp_path), *TINY, "--num-prompts", "6",
                     "--max-concurrency", "3", "--input-len", "8", "--output-len", "5",
                     "--token-id-range", "1", "250", "--offline", "--result-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["successful_requests"] == 6 and res["total_output_tokens"] == 30
    off = res["offline"]
    assert off["max_num_seqs"] == 3 and off["total_output_tokens"] == 30
    assert off["server_over_offline"] == pytest.approx(
        res["output_throughput"] / off["output_throughput"])
    assert res["server"]["kv_dtype"] and res["server"]["pages_total"] == 64
    assert "server/offline output throughput" in capsys.readouterr().out


def test_bench_serve_step_logs(tmp_path, capsys):
    """``--step-log``: the server's engine process and the offline run each log every step; the
    summaries count the run's tokens (the server's warm-up request left out)."""
    from kvfit.bench.serve import main as serve_main

    prefix = str(tmp_path / "steps")
    out = tmp_path / "serve.json"
    rc = serve_main(["--model", tiny_config(tmp_path), *TINY, "--num-prompts", "4",
                     "--max-concurrency", "2", "--input-len", "8", "--output-len", "5",
                     "--token-id-range", "1", "250", "--offline", "--step-log", prefix,
                     "--result-json", str(out)])
    assert rc == 0
    steps = json.loads(out.read_text())["steps"]
    for run in ("server", "offline"):
        log = json.loads((tmp_path / f"steps.{run}.json").read_text())
        assert log["columns"][:2] == ["t_start", "seconds"]
        s = steps[run]
        # 4 requests x 8 prompt tokens; every output token but each request's first is a decode
        assert s["prefill_tokens"] == 32, run
        assert s["decode_rows"] == 4 * 4, run
        assert s["busy_s"] <= s["span_s"] + 1e-9
    assert "engine steps (server)" in capsys.readouterr().out
