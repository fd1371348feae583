"""CUDA graphs of prefill/extend steps (engine/prefill_graph.py): a cached-prefix extend next to
a decode token, replayed from a padded bucket, gives the eager step's and the torch reference's
hidden states (within rounding) and tokens, every KV format; whole engines with prefill graphs on and off give the
same greedy tokens with prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import json

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata

from kvhelpers import DEV, random_tables
from test_cuda_graph import make_backend

pytestmark = pytest.mark.gpu


def tiny_model():
    """test_cuda_graph's tiny Llama with 128-d heads and 2,048 positions."""
    from transformers import LlamaConfig

    from kvfit.models.llama import LlamaForCausalLM
    from kvfit.models.weights import init_dummy

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg, 2048)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        init_dummy(model, 0)
        model.lm_head.weight.normal_(0, 1.0)  # well separated logits: greedy is stable
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return cfg, model


def _extend_step(prefix_lens, new_lens):
    """Random cached prefixes and the new tokens of one step after them -> (prefixes, new,
    q_lens, kv_lens, device ids [T], device positions [T])."""
    prefixes = [torch.randint(0, 512, (n,)).tolist() for n in prefix_lens]
    new = [torch.randint(0, 512, (n,)).tolist() for n in new_lens]
    q_lens = [len(x) for x in new]
    kv_lens = [len(p) + len(x) for p, x in zip(prefixes, new)]
    ids = torch.tensor(sum(new, []), device=DEV)
    pos = torch.tensor([len(p) + i for p, x in zip(prefixes, new) for i in range(len(x))],
                       device=DEV)
    return prefixes, new, q_lens, kv_lens, ids, pos


@torch.inference_mode()
def _prefill(model, ctx, prompts, tables):
    ps = ctx.pool.page_size
    q_lens = [len(p) for p in prompts]
    ctx.backend.prepare(build_metadata(q_lens, q_lens, tables, ps, DEV))
    ids = torch.tensor(sum(prompts, []), device=DEV)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=DEV)
    model(ids, pos, ctx)


def _graph_eager_torch(kv_dtype, prefix_lens, new_lens, max_tokens, bucket, check_graph=None):
    """One step (extends of ``new_lens`` tokens after cached prefixes of ``prefix_lens``) three
    ways: eager triton, replayed from the ``bucket`` graph of ``PrefillGraphs(max_tokens)``
    (``check_graph(ctx)`` right after the replay), and the torch reference. The graph's hidden
    states are close to both (the padded bucket's matmuls have more rows, so cuBLAS may pick
    another kernel: not necessarily the same bits), and all three give the same tokens. A
    second replay of a smaller step in the same graphs reads no leftovers."""
    from kvfit.engine.prefill_graph import PrefillGraphs

    cfg, model = tiny_model()
    ps, num_pages = 16, 200
    prefixes, _, q_lens, kv_lens, ids, pos = _extend_step(prefix_lens, new_lens)
    width = -(-max(kv_lens) // ps) + 1
    tables = random_tables([-(-n // ps) * ps + ps for n in kv_lens], ps, num_pages)
    hidden = {}
    for name in ("eager", "graph", "torch"):
        ctx = make_backend("torch" if name == "torch" else "triton", cfg, model, kv_dtype,
                           num_pages, ps)
        graphs = PrefillGraphs(model, ctx, max_tokens, width, DEV) if name == "graph" else None
        _prefill(model, ctx, prefixes, tables)
        with torch.inference_mode():
            if graphs is None:
                ctx.backend.prepare(build_metadata(q_lens, kv_lens, tables, ps, DEV))
                h = model(ids, pos, ctx)
            else:
                assert graphs.bucket_for(q_lens) == bucket
                h = graphs.run(ids, pos, q_lens, kv_lens, tables).clone()
                if check_graph is not None:
                    check_graph(ctx)
                graphs.run(ids[:5], pos[:5], [5], [len(prefixes[0]) + 5], tables[:1])
        hidden[name] = h.float()
    assert torch.isfinite(hidden["graph"]).all()
    err = ((hidden["graph"] - hidden["eager"]).norm() / hidden["eager"].norm()).item()
    assert err < 1e-2, err
    err = ((hidden["graph"] - hidden["torch"]).norm() / hidden["torch"].norm()).item()
    assert err < 3e-2, err
    ends = torch.tensor(q_lens, device=DEV).cumsum(0) - 1  # each request's last new token
    toks = {k: model.compute_logits(h[ends].to(torch.bfloat16)).argmax(-1).tolist()
            for k, h in hidden.items()}
    assert toks["graph"] == toks["eager"] == toks["torch"]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "int8"])
def test_graph_extend_equals_eager_and_reference(kv_dtype):
    """A 60-token extend over a 1,100-token prefix and a decode, from the 64 bucket."""
    torch.manual_seed(3)
    _graph_eager_torch(kv_dtype, (1100, 300), (60, 1), 128, 64)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_large_bucket_attends_unsplit_like_eager(kv_dtype):
    """Buckets above SPLIT_MAX_TOKENS (``--cuda-graph-max-prefill-tokens`` > 512): a 601-token
    step (a 600-token extend and a decode) replays the 1,024 bucket unsplit, as the eager step
    of its size runs, and gives the eager step's and the reference's tokens."""
    from kvfit.kernels.prefill_split import SPLIT_MAX_TOKENS

    assert SPLIT_MAX_TOKENS == 512

    def unsplit(ctx):
        assert ctx.backend._split_step is False

    torch.manual_seed(11)
    _graph_eager_torch(kv_dtype, (700, 40), (600, 1), 1024, 1024, unsplit)


def test_linked_graphs_equal_one_graph(monkeypatch):
    """The forward captured as a chain of graphs cut at layer boundaries (the default,
    engine/graph_segments.py) replays exactly the one-graph capture: the same bits."""
    from kvfit.engine import graph_segments
    from kvfit.engine.prefill_graph import PrefillGraphs

    torch.manual_seed(5)
    cfg, model = tiny_model()
    ps, num_pages = 16, 200
    prefixes, _, q_lens, kv_lens, ids, pos = _extend_step((700, 90), (100, 1))
    tables = random_tables([900, 200], ps, num_pages)
    out = {}
    for growth in (0, 1):
        monkeypatch.setattr(graph_segments, "GROWTH", growth)
        ctx = make_backend("triton", cfg, model, "fp8_e4m3", num_pages, ps)
        graphs = PrefillGraphs(model, ctx, 128, 900 // ps + 1, DEV)
        assert graphs.links == (1 if growth == 0 else cfg.num_hidden_layers)
        assert all(len(chain) == graphs.links for chain in graphs.graphs.values())
        _prefill(model, ctx, prefixes, tables)
        out[growth] = graphs.run(ids, pos, q_lens, kv_lens, tables).clone()
        assert torch.isfinite(out[growth].float()).all()
    assert torch.equal(out[0], out[1])


CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
           intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=4096,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
           torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def _engine_run(path, kv_dtype, graph_tokens, num_pages):
    from kvfit.engine import prefill_graph
    from kvfit.kernels import prefill_split
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    calls = []
    run = prefill_graph.PrefillGraphs.run

    def counted(self, *a, **k):
        calls.append(1)
        return run(self, *a, **k)

    prefill_graph.PrefillGraphs.run = counted
    prefill_split.EAGER_SPLIT = True  # eager steps split as graph steps do: the same bits
    try:
        llm = LLM(str(path), load_format="dummy", attention_backend="triton", kv_dtype=kv_dtype,
                  device="cuda", num_pages=num_pages, page_size=16, max_model_len=1536,
                  max_num_seqs=6, max_num_batched_tokens=256,
                  cuda_graph_max_prefill_tokens=graph_tokens)
        shared = [(11 * j) % 500 + 3 for j in range(1300)]
        prompts = [shared + [(7 * i + 3 * j) % 500 + 3 for j in range(n)]
                   for i, n in enumerate((5, 33, 70, 17, 9, 120))]
        prompts.append([(5 * j) % 500 + 3 for j in range(40)])
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        first = llm.generate(prompts[:1], sp, use_tqdm=False)  # caches the shared prefix
        outs = first + llm.generate(prompts[1:], sp, use_tqdm=False)
        eng = llm.engine
        assert eng.allocator.num_free == eng.allocator.num_pages  # cached pages are free too
        pre = eng.scheduler.num_preemptions
        del llm, eng
    finally:
        prefill_graph.PrefillGraphs.run = run
        prefill_split.EAGER_SPLIT = False
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], pre, len(calls)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3", "int8"])
def test_engine_prefill_graphs_equal_eager(tmp_path, kv_dtype):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    want, _, none = _engine_run(path, kv_dtype, 0, 400)
    got, _, calls = _engine_run(path, kv_dtype, 256, 400)
    assert none == 0 and calls > 0
    assert got == want
    # a pool too small for every request at once: preemption by recompute, still exact
    want, pre, _ = _engine_run(path, kv_dtype, 0, 100)
    got, pre_g, calls = _engine_run(path, kv_dtype, 256, 100)
    assert pre > 0 and pre_g > 0 and calls > 0 and got == want
