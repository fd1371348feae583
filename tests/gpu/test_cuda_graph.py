"""CUDA-graph decode (DecodeGraphs) gives the same greedy tokens as eager decode, per backend,
on a tiny random-weight Llama, with a batch that needs padding up to a captured size."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata

from kvhelpers import DEV, random_tables

pytestmark = pytest.mark.gpu


def tiny_model(head_dim=64):
    from transformers import LlamaConfig

    from kvfit.models.llama import LlamaForCausalLM
    from kvfit.models.weights import init_dummy

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=512,
                      max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg, 1024)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        init_dummy(model, 0)
        model.lm_head.weight.normal_(0, 1.0)  # well separated logits: greedy is stable
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return cfg, model


def make_backend(name, cfg, model, kv_dtype, num_pages, page_size):
    from kvfit.attention.registry import backend_class, unavailable_reason
    from kvfit.engine.context import Context
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache

    why = unavailable_reason(name, "cuda")
    if why:
        pytest.skip(why)
    layers = model.kv_layer_specs(cfg)
    cls = backend_class(name)
    pool = MHAKVCache(layers, num_pages, page_size, kv_format(kv_dtype), DEV,
                      v_layout=cls.v_layout(kv_dtype, page_size, layers[0].head_dim))
    be = cls(pool, torch.bfloat16, model.sm_scale(cfg))
    return Context(be, pool, torch.bfloat16)


@torch.inference_mode()
def generate(model, ctx, prompts, tables, steps, graphs=None):
    ps = ctx.pool.page_size
    q_lens = [len(p) for p in prompts]
    meta = build_metadata(q_lens, q_lens, tables, ps, DEV)
    ids = torch.tensor(sum(prompts, []), device=DEV)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=DEV)
    ctx.backend.prepare(meta)
    hidden = model(ids, pos, ctx)
    last = torch.tensor(q_lens).cumsum(0) - 1
    toks = model.compute_logits(hidden[last.to(DEV)]).argmax(-1)
    out = [toks.tolist()]
    lens = list(q_lens)
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        pos = torch.tensor([n - 1 for n in lens], device=DEV)
        if graphs is None:
            meta = build_metadata([1] * len(lens), lens, tables, ps, DEV)
            ctx.backend.prepare(meta)
            hidden = model(toks, pos, ctx)
        else:
            hidden = graphs.run(toks, pos, lens, tables)
        toks = model.compute_logits(hidden).argmax(-1)
        out.append(toks.tolist())
    return out


@pytest.mark.parametrize("backend", ["triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128])  # fp8 at 128: token-minor V pages (triton)
def test_graph_decode_equals_eager(backend, kv_dtype, head_dim):
    from kvfit.engine.cuda_graph import DecodeGraphs

    torch.manual_seed(0)
    cfg, model = tiny_model(head_dim)
    ps, num_pages = 16, 64
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 40, 17)]
    tables = random_tables([200, 200, 200], ps, num_pages)
    ctx_e = make_backend(backend, cfg, model, kv_dtype, num_pages, ps)
    eager = generate(model, ctx_e, prompts, tables, 12)
    ctx_g = make_backend(backend, cfg, model, kv_dtype, num_pages, ps)
    graphs = DecodeGraphs(model, ctx_g, 8, 200 // ps + 1, DEV)
    assert graphs.can_run(3) and not graphs.can_run(9)
    graphed = generate(model, ctx_g, prompts, tables, 12, graphs)
    assert graphed == eager
    # and eager on the torch reference backend agrees on the first tokens
    ctx_r = make_backend("torch", cfg, model, kv_dtype, num_pages, ps)
    ref = generate(model, ctx_r, prompts, tables, 4)
    assert ref == eager[:5]
