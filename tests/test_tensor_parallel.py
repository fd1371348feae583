"""Tensor parallelism on CPU (gloo, one process per rank): the split arithmetic, the guard, and
TP=N against TP=1 on the same weights: greedy tokens equal, logprobs within a measured
tolerance (the row-parallel sums add the ranks' partial products in another order than one
matmul: float32 differences of ~1e-6 relative, see docs/tensor_parallel.md)."""

from __future__ import annotations

import dataclasses

import pytest

from kvfit import LLM, SamplingParams
from kvfit.config import EngineConfig
from kvfit.engine.settings import resolve_settings
from kvfit.errors import UnsupportedCombinationError
from kvfit.parallel.layout import shard_heads, shard_vocab, tp_refusals

# measured: max |logprob(TP=2) - logprob(TP=1)| on the tiny models ~1e-6 (float32); 1e-4 leaves
# room for other BLAS orders without hiding a wrong shard (which moves logprobs by > 0.1)
LOGPROB_TOL = 1e-4


def test_head_split_and_kv_replication():
    # 8 query / 2 KV heads over 4 ranks: 2 query heads each, KV head 0 on ranks 0-1, 1 on 2-3
    shards = [shard_heads(8, 2, r, 4) for r in range(4)]
    assert [(s.q_start, s.q_count) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv_start, s.kv_count) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for s in shards:  # every query head of the rank reads a KV head the rank holds
        group = 8 // 2
        assert all(s.kv_start <= h // group < s.kv_start + s.kv_count
                   for h in range(s.q_start, s.q_start + s.q_count))
    # 9 query / 3 KV (SmolLM2) over 3 ranks: one KV head each
    assert [shard_heads(9, 3, r, 3).kv_start for r in range(3)] == [0, 1, 2]
    # vocabulary: padded rows only at the tail, every id on exactly one rank
    parts = [shard_vocab(10, r, 4) for r in range(4)]
    assert [(p.start, p.count) for p in parts] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert {p.padded for p in parts} == {3}


def test_refusals_name_the_reason():
    assert tp_refusals(9, 3, 1536, 3) == []
    assert tp_refusals(8, 2, 64, 4) == []
    assert any("more than the model's 4 query heads" in r for r in tp_refusals(4, 2, 64, 8))
    assert any("does not divide the model's 9 query heads" in r
               for r in tp_refusals(9, 3, 1536, 2))
    assert any("KV heads do not divide 4 ranks" in r for r in tp_refusals(12, 3, 96, 4))
    assert any("intermediate size 100" in r for r in tp_refusals(8, 8, 100, 8))


@pytest.fixture(scope="module")
def smol_shape(tmp_path_factory):
    """A config.json of SmolLM2's head layout (9 query / 3 KV heads) at a tiny size: the guard
    and the settings read the config only (parsing the GGUF header costs seconds)."""
    import json

    d = tmp_path_factory.mktemp("smol-shape")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=72,
               intermediate_size=96, num_hidden_layers=2, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=300, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True,
               torch_dtype="float32")
    path = d / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _settings(model, tp, **kw):
    return resolve_settings(EngineConfig(model=model, device="cpu", load_format="dummy",
                                         tensor_parallel_size=tp, **kw))


def test_guard_refuses_before_loading(smol_shape):
    with pytest.raises(UnsupportedCombinationError, match="9 query heads.*--tensor-parallel"):
        _settings(smol_shape, 2)
    with pytest.raises(UnsupportedCombinationError, match="more than the model's 9 query heads"):
        _settings(smol_shape, 12)
    from kvfit.bench.configs import config_path

    # DeepSeek-V2-Lite (16 query heads, MoE): its own rule (heads and experts' sizes)
    assert _settings(config_path("deepseek-v2-lite"), 2).tp_size == 2
    with pytest.raises(UnsupportedCombinationError, match="does not divide the model's 16 query "
                       "heads.*experts' intermediate size"):
        _settings(config_path("deepseek-v2-lite"), 3)
    with pytest.raises(UnsupportedCombinationError, match="kv-scales auto"):
        _settings(smol_shape, 3, kv_scales="auto")


def test_settings_hold_one_ranks_kv_heads(smol_shape):
    s = _settings(smol_shape, 3)
    assert {l.num_kv_heads for l in s.layers} == {1}
    assert {l.num_kv_heads for l in s.full_layers} == {3}
    assert _settings(smol_shape, 1).layers == s.full_layers


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A word-level tokenizer of the tiny models' 256 ids (the prompts here are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-tokenizer")
    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0").save_pretrained(str(d))
    return str(d)


def _generate(model_dir, tokenizer, tp, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    with LLM(model_dir, tokenizer=tokenizer, device="cpu", num_pages=32, page_size=4,
             max_model_len=128, tensor_parallel_size=tp, **kw) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def _max_logprob_gap(a, b) -> float:
    gap = 0.0
    for x, y in zip(a, b):
        pairs = list(zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
        pairs += [(p, q) for p, q in zip(x.prompt_logprobs or [], y.prompt_logprobs or []) if p]
        for p, q in pairs:
            for tok, lp in p.items():
                gap = max(gap, abs(lp - q[tok]))
    return gap


def test_flags_and_kwargs():
    import argparse

    from kvfit.config import add_engine_args, config_from_args, make_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flag in ("--tensor-parallel-size", "--tp-size", "--tp"):
        assert config_from_args(p.parse_args([flag, "4"])).tensor_parallel_size == 4
    assert make_config(tp_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        make_config(tensor_parallel_size=0)


@pytest.mark.parametrize("arch,kv_dtype", [("llama", "auto"), ("qwen3", "auto"),
                                           ("llama", "fp8_e4m3")])
def test_tp2_equals_tp1_on_tiny_models(tiny_models, word_tokenizer, arch, kv_dtype):
    """Safetensors checkpoints read lazily (each rank reads its slices); GQA 4/2 heads; the
    KV format runs per rank unchanged (fp8: each rank quantizes its own heads)."""
    d = tiny_models[arch][0]
    prompts = [[3, 17, 42, 99, 5, 61, 7], [200, 1, 2, 3], list(range(10, 40))]
    one = _generate(d, word_tokenizer, 1, prompts, kv_dtype=kv_dtype)
    two = _generate(d, word_tokenizer, 2, prompts, kv_dtype=kv_dtype)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert _max_logprob_gap(two, one) < LOGPROB_TOL


def test_tp_engine_can_be_rebuilt_and_replaced_by_tp1(tiny_models, word_tokenizer):
    """close() stops the workers and leaves the group: the next engine (any size) starts."""
    d, tok = tiny_models["llama"][0], word_tokenizer
    a = _generate(d, tok, 2, [[1, 2, 3]])
    b = _generate(d, tok, 2, [[1, 2, 3]])
    c = _generate(d, tok, 1, [[1, 2, 3]])
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[0].outputs[0].token_ids


SMOL_PROMPTS = ["The capital of France is", "def add(a, b):",
                "Once upon a time, in a small village,", "List three colors:", "Water boils at"]


def test_tp3_equals_tp1_on_bundled_smollm2_with_chunks_and_preemption(bundled_llm):
    """SmolLM2 (9 query / 3 KV heads, GGUF): 3 ranks with one KV head each. A 5-token step
    budget forces chunked prefill and 12 pages of 4 force preemption; the greedy tokens equal
    TP=1's (the session's bundled engine: greedy output does not depend on batching, chunking
    or preemption, tests/test_engine.py) and the pages all come back."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    one = bundled_llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    with LLM("smollm2-135m", device="cpu", num_pages=12, page_size=4, max_num_batched_tokens=5,
             max_model_len=48, tensor_parallel_size=3) as llm:
        three = llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
        eng = llm.engine
        assert eng.scheduler.num_preemptions > 0
        assert eng.allocator.num_free == eng.allocator.num_pages
        assert {l.num_kv_heads for l in eng.runner.pool.layers} == {1}
    assert [o.outputs[0].token_ids for o in three] == [o.outputs[0].token_ids for o in one]
    assert _max_logprob_gap(three, one) < LOGPROB_TOL


def _descendants_running(root: int, needle: str) -> list[int]:
    """Pids of ``root``'s descendants whose command line contains ``needle`` (Linux /proc)."""
    import os

    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out = []
    for pid in parent:
        p = pid
        while p in parent and p != root and p > 1:
            p = parent[p]
        if p == root:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        out.append(pid)
            except OSError:
                continue
    return out


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("when", ["decode", "prefill"])
def test_dead_worker_gives_503_and_the_server_exits_nonzero(tmp_path, when):
    """Kill rank 1 while a request decodes (after its first streamed token) or while its
    prompt is being prefilled (the worker is frozen first, so rank 0 is inside the prefill
    step, waiting on the worker's collective, when the kill lands): the request is answered
    503 naming the lost rank (an error event ending the stream, or the response itself when
    nothing was streamed yet), and the server stops by itself with a non-zero status (never
    hangs)."""
    import json
    import os
    import signal
    import time

    from server_common import ServerProcess, start_stream, stream_error

    with ServerProcess(tmp_path, "--tp-size", "2") as server:
        workers = _descendants_running(server.proc.pid, "kvfit.engine.tp_worker")
        assert len(workers) == 1
        body = {"prompt": [3, 4], "max_tokens": 500, "ignore_eos": True}
        if when == "prefill":
            os.kill(workers[0], signal.SIGSTOP)
            body.update(prompt=[(7 * i) % 250 + 1 for i in range(300)], max_tokens=100)
        streamer, lines, first = start_stream(server.base + "/v1/completions", body)
        if when == "decode":
            assert first.wait(60)
            assert any('"text"' in line for line in lines[1:])  # tokens streamed
        else:
            time.sleep(1.5)  # rank 0 hands the first step over and blocks in its collective
            assert not first.is_set(), lines  # nothing streamed: the prompt is not prefilled
        os.kill(workers[0], signal.SIGKILL)
        code = server.proc.wait(90)
        streamer.join(10)
        assert code != 0, server.output()
        if when == "decode":  # the stream had started: it ends with an error event
            err = stream_error(lines)
        else:  # nothing was streamed yet: the response is the error
            assert lines[0] == 503 and len(lines) == 2, lines
            err = json.loads(lines[1])["error"]
        assert err["type"] == "service_unavailable" and "rank 1" in err["message"]


def test_plan_reports_per_gpu_and_total():
    """Llama-3.1-8B (8 KV heads) at TP=2: each GPU's pool holds 4 KV heads, so the same per-GPU
    budget holds 2x the tokens; the plan says per GPU and in total."""
    from kvfit.bench.configs import config_path
    from kvfit.plan import format_plan, plan_capacity

    cfg = EngineConfig(model=config_path("llama-3.1-8b"), load_format="dummy",
                       max_model_len=16384)
    gib = 2**30
    one = plan_capacity(cfg, 100 * gib, ("bfloat16", "fp8_e4m3"), device="cuda")
    two = plan_capacity(dataclasses.replace(cfg, tensor_parallel_size=2), 100 * gib,
                        ("bfloat16", "fp8_e4m3"), device="cuda")
    for a, b in zip(one, two):
        assert b.sizing.bytes_per_token * 2 == a.sizing.bytes_per_token
        assert b.sizing.tokens == 2 * a.sizing.tokens
        line = b.capacity_line()
        assert "over 2 GPUs" in line and "per GPU 100.00 GiB" in line and "total 200.00" in line
    text = format_plan(100 * gib, two)
    assert "per GPU on 2 cuda GPUs" in text and "4 of the 8 KV heads" in text


def test_plan_lines_for_hybrid_and_mla_pools():
    """Gemma-3-4B (4 KV heads, sliding windows): each GPU's hybrid pool holds half of every
    token's KV at TP=2, so the same budget holds 2x the tokens; DeepSeek-V2-Lite (MLA): every
    GPU keeps the whole latent, the same tokens as one GPU, and the plan says so."""
    from kvfit.bench.configs import config_path
    from kvfit.plan import format_plan, plan_capacity

    gib = 2**30
    for name, grows in (("gemma3-4b", True), ("deepseek-v2-lite", False)):
        cfg = EngineConfig(model=config_path(name), load_format="dummy", max_model_len=8192)
        one = plan_capacity(cfg, 20 * gib, ("bfloat16",), device="cuda")[0]
        two = plan_capacity(dataclasses.replace(cfg, tensor_parallel_size=2), 20 * gib,
                            ("bfloat16",), device="cuda")[0]
        line = two.capacity_line()
        if grows:
            assert two.sizing.bytes_per_token * 2 == one.sizing.bytes_per_token
            assert two.sizing.tokens >= 2 * one.sizing.tokens * 0.95  # sliding share aside
            assert "tensor parallel over 2 GPUs" in line and "holding 50% of every token" in line
        else:
            assert two.sizing.tokens == one.sizing.tokens
            assert "every GPU keeps the whole latent cache" in line and "(1.00x" in line
            assert "does not grow" in format_plan(20 * gib, [two])
