"""The GPU benches' flags on CPU: engine flags come from EngineConfig (one source), the shipped
model configs are package data, and a bad flag is refused before any GPU work."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from kvfit.bench import kernels as bench_kernels
from kvfit.bench import seed as bench_seed
from kvfit.bench.configs import NAMES, config_path
from kvfit.config import EngineConfig


def test_shipped_configs_are_hf_configs_inside_the_package():
    import kvfit

    pkg = os.path.dirname(kvfit.__file__)
    for name in NAMES:
        path = config_path(name)
        assert os.path.commonpath([pkg, path]) == pkg
        with open(path) as f:
            cfg = json.load(f)
        assert cfg["num_hidden_layers"] > 0 and cfg["vocab_size"] > 0
    with pytest.raises(ValueError, match="qwen3-1.7b"):
        config_path("qwen3-17b")


def test_seed_defaults_are_the_engine_defaults():
    args = bench_seed.parser().parse_args([])
    cfg = bench_seed.engine_config(args, "fp8_e4m3", 4096, 2048, 16)
    assert cfg.model == config_path("qwen3-1.7b")
    for f in dataclasses.fields(EngineConfig):
        if f.name not in bench_seed.BENCH_SETS:
            assert getattr(cfg, f.name) == f.default, f.name
    assert (cfg.kv_dtype, cfg.load_format, cfg.device, cfg.num_tokens) == (
        "fp8_e4m3", "dummy", "cuda", 4096)
    assert cfg.max_num_seqs == cfg.cuda_graph_max_bs == 16
    assert cfg.max_num_batched_tokens == args.prefill_len


def test_seed_engine_flags_and_aliases_reach_the_config():
    args = bench_seed.parser().parse_args([
        "--attention-backend", "triton", "--block-size", "32", "--gpu-memory-utilization", "0.8",
        "--no-cuda-graph", "--dtype", "float16", "--seed", "7", "--model", "x/config.json",
        "--tp-size", "2"])
    cfg = bench_seed.engine_config(args, "bfloat16", 1024, 512, 4)
    assert (cfg.attention_backend, cfg.page_size, cfg.memory_ratio, cfg.enforce_eager,
            cfg.dtype, cfg.seed, cfg.model, cfg.tensor_parallel_size) == (
        "triton", 32, 0.8, True, "float16", 7, "x/config.json", 2)


@pytest.mark.parametrize("argv", [["--attention-backend", "cuda"], ["--page-size", "0"],
                                  ["--memory-ratio", "1.5"], ["--num-pages", "10"]])
def test_seed_refuses_bad_engine_flags(argv):
    with pytest.raises((SystemExit, ValueError)):
        args = bench_seed.parser().parse_args(argv)
        bench_seed.engine_config(args, "bfloat16", 1024, 512, 4)


def test_kernels_page_size_is_the_engine_flag():
    p = bench_kernels.parser()
    assert p.parse_args([]).page_size is EngineConfig.page_size
    assert p.parse_args(["--block-size", "64"]).page_size == 64
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-scales", "auto"])  # not a kernel flag


def test_kernels_time_one_ranks_heads_under_tensor_parallelism(capsys):
    p = bench_kernels.parser()
    assert p.parse_args([]).tensor_parallel_size == 1
    assert p.parse_args(["--tp-size", "2"]).tensor_parallel_size == 2
    assert bench_kernels.rank_heads("llama-3.1-8b", 2) == (16, 4, 128)
    assert bench_kernels.rank_heads("smollm2", 3) == (3, 1, 64)  # one KV head per rank
    # refused before any GPU work, naming the layout and why
    assert bench_kernels.main(["--layouts", "llama-3.1-8b,smollm2", "--tp-size", "2"]) == 2
    out = capsys.readouterr().out
    assert "smollm2: 2 ranks does not divide the model's 9 query heads" in out
    assert "llama-3.1-8b" not in out.split(":", 1)[1]
