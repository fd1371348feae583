"""kvfit/bench/weight_reads.py: the weight bytes a step reads, for the rooflines: routed experts
by the experts a step chooses, an untied embedding table a row a token, the rest whole."""

import dataclasses
import random

import pytest
import torch

from kvfit.bench.weight_reads import bytes_read, weight_reads

from test_mla import _tiny_cfg


def _param_bytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def test_moe_model_reads_the_chosen_experts_and_an_embedding_row():
    from kvfit.models.deepseek_v2 import DeepseekV2ForCausalLM

    cfg = _tiny_cfg("lite")  # 3 layers, the first dense; 8 routed experts, 2 a token; untied
    torch.manual_seed(random.randrange(1 << 30))
    model = DeepseekV2ForCausalLM(cfg, max_positions=256).eval()
    reads = weight_reads(model)
    total = _param_bytes(dict((id(p), p) for p in model.parameters()).values())
    assert reads.total == total
    moe = [m for m in model.modules() if type(m).__name__ == "MoE"]
    assert len(moe) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    one = _param_bytes(moe[0].experts[0].parameters())  # one expert's bytes
    assert reads.routed == tuple((8 * one, 8, 2) for _ in moe)
    emb = model.model.embed_tokens.weight
    assert (reads.embed_table, reads.embed_row) == (emb.numel() * 4, emb.shape[1] * 4)

    # a one-token forward runs top_k experts of each MoE layer: the price reads exactly those
    called = {id(m): set() for m in moe}
    for m in moe:
        for e, expert in enumerate(m.experts):
            expert.register_forward_hook(lambda mod, i, o, m=m, e=e: called[id(m)].add(e))
    with torch.no_grad():
        for m in moe:
            m(torch.randn(1, cfg.hidden_size))
    assert all(len(s) == cfg.num_experts_per_tok for s in called.values())
    read_experts = sum(len(s) * one for s in called.values())
    want = total - sum(b for b, _, _ in reads.routed) + read_experts - emb.numel() * 4 \
        + emb.shape[1] * 4
    assert bytes_read(reads, 1) == pytest.approx(want)
    # more tokens: more distinct experts expected, never more than all of them
    prices = [bytes_read(reads, t) for t in (1, 2, 8, 64, 4096)]
    assert prices == sorted(prices)
    assert prices[-1] == pytest.approx(total - emb.numel() * 4 + 4096 * emb.shape[1] * 4)
    # a benchmark's JSON form prices the same
    assert bytes_read(dataclasses.asdict(reads), 8) == bytes_read(reads, 8)


@pytest.mark.parametrize("tied", [True, False])
def test_dense_model_reads_every_weight_but_an_untied_embedding_table(tied):
    from transformers import LlamaConfig

    from kvfit.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=80,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg, 64).eval()
    reads = weight_reads(model)
    assert reads.routed == ()
    table = 80 * 32 * 4
    if tied:  # the LM head multiplies by the table: all of it is read every step
        assert (reads.embed_table, reads.embed_row) == (0, 0)
        assert model.lm_head is None and bytes_read(reads, 1) == reads.total
    else:
        assert (reads.embed_table, reads.embed_row) == (table, 32 * 4)
        assert bytes_read(reads, 3) == reads.total - table + 3 * 32 * 4
