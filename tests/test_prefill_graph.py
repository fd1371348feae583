"""The host side of prefill CUDA graphs on CPU (engine/prefill_graph.py, prefill_staging.py):
token buckets, the staged metadata against the eager builder (padded tokens store nothing,
padded requests hold no tokens, spare programs and chunks are marked), the fixed grids' bounds
over random steps, and the runner's dispatch with a fake graph set that runs the padded step
eagerly (the same greedy tokens as without it, with chunked prefill and preemption)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.attention.meta_builder import build_metadata
from kvfit.config import EngineConfig
from kvfit.engine.prefill_graph import MAX_REQS, PrefillGraphs, prefill_buckets
from kvfit.engine.prefill_staging import PrefillStaging
from kvfit.kernels.prefill import prefill_block_list
from kvfit.kernels.store import store_chunk_list


def test_buckets_and_flag_bounds():
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(2048)[-3:] == [512, 1024, 2048]
    EngineConfig(cuda_graph_max_prefill_tokens=8192)  # up to the default step budget
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(8) == [8]
    for bad in (-1, 8193):
        with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens"):
            EngineConfig(cuda_graph_max_prefill_tokens=bad)
    g = PrefillGraphs.__new__(PrefillGraphs)
    g.sizes, g.max_tokens = prefill_buckets(64), 64
    assert g.bucket_for([1]) == 16 and g.bucket_for([16]) == 16 and g.bucket_for([9, 8]) == 32
    assert g.bucket_for([64]) == 64 and g.bucket_for([65]) is None
    assert g.bucket_for([1] * MAX_REQS) == 16 and g.bucket_for([1] * (MAX_REQS + 1)) is None


def _random_step(rng, max_tokens, ps, max_pages):
    b = rng.randint(1, MAX_REQS)
    q_lens = [1] * b
    for _ in range(rng.randint(0, max_tokens - b)):
        q_lens[rng.randrange(b)] += 1
    kv_lens = [q + rng.randint(0, (max_pages - 1) * ps - q) for q in q_lens]
    pages = list(range(MAX_REQS * max_pages))
    rng.shuffle(pages)
    tables = [pages[i * max_pages:(i + 1) * max_pages][:-(-kv // ps)]
              for i, kv in enumerate(kv_lens)]
    return q_lens, kv_lens, tables


@pytest.mark.parametrize("page_size,group,block_m", [(16, 2, 64), (32, 4, 128), (8, 1, 16)])
def test_staging_matches_eager_metadata(page_size, group, block_m):
    rng = random.Random(int.from_bytes(np.random.bytes(2), "little"))
    max_tokens = 128
    max_pages = max_tokens // page_size + 4  # room for any request of the step and a prefix
    st = PrefillStaging(max_tokens, MAX_REQS, max_pages, page_size, group, block_m, "cpu")
    for _ in range(40):  # rows, lists and buckets shrink and grow between steps
        q_lens, kv_lens, tables = _random_step(rng, max_tokens, page_size, max_pages)
        t, b = sum(q_lens), len(q_lens)
        bucket = min(s for s in prefill_buckets(max_tokens) if s >= t)
        n_pages = st.stage(q_lens, kv_lens, tables, bucket, True)
        ref = build_metadata(q_lens, kv_lens, tables, page_size, "cpu")
        assert n_pages == ref.num_pages_cpu + [0] * (MAX_REQS - b)
        assert torch.equal(st.slot_mapping[:t], ref.slot_mapping)
        assert (st.slot_mapping[t:bucket] == -1).all()  # padded tokens store nothing
        assert torch.equal(st.cu_seqlens[:b + 1], ref.cu_seqlens_q)
        assert (st.cu_seqlens[b + 1:] == t).all()  # padded requests: no tokens
        assert torch.equal(st.kv_lens[:b], ref.kv_lens) and (st.kv_lens[b:] == 0).all()
        for i in range(b):
            k = ref.num_pages_cpu[i]
            assert torch.equal(st.block_table[i, :k], ref.block_table[i, :k])
        nb, nc = st.grid(bucket)
        blocks = prefill_block_list(q_lens, group, block_m, kv_lens)
        chunks = store_chunk_list(q_lens, kv_lens, page_size)
        assert len(blocks) <= 2 * nb and len(chunks) <= 2 * nc  # the fixed grids hold them
        assert st.blocks[:nb].flatten().tolist() == blocks + [-1] * (2 * nb - len(blocks))
        assert st.chunks[:nc].flatten().tolist() == chunks + [-1] * (2 * nc - len(chunks))
    with pytest.raises(ValueError, match="does not fit a prefill graph"):
        st.stage([100, 100], [100, 100], [[0] * 13, [1] * 13], 128, False)


class FakeGraphs(PrefillGraphs):
    """The real bucketing; a "replay" runs the step padded to its bucket eagerly on the runner's
    backend (the spare tokens a request of their own, storing nothing) and returns the real
    rows, as the graphs do."""

    def __init__(self, runner, max_tokens):
        self.runner, self.max_tokens = runner, max_tokens
        self.sizes = prefill_buckets(max_tokens)
        self.buckets_run = []

    def run(self, input_ids, positions, q_lens, kv_lens, page_tables):
        r = self.runner
        bucket = self.bucket_for(q_lens)
        self.buckets_run.append(bucket)
        t = sum(q_lens)
        pad = bucket - t
        ids = torch.cat([input_ids, torch.randint(0, 100, (pad,))])
        pos = torch.cat([positions, torch.zeros(pad, dtype=torch.long)])
        meta = build_metadata(list(q_lens) + [pad], list(kv_lens) + [pad],
                              list(page_tables) + [[0] * -(-pad // r.pool.page_size)],
                              r.pool.page_size, r.device, num_real_reqs=len(q_lens))
        r.backend.prepare(meta)
        return r.model(ids, pos, r.ctx)[:t]


CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
           torch_dtype="float32", bos_token_id=1, eos_token_id=2)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_runner_dispatch_with_fake_graphs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 30, 17, 9, 26, 12, 21, 8)]

    def run(fake, **kw):
        llm = LLM(str(tmp_path / "config.json"), load_format="dummy", device="cpu",
                  page_size=4, max_model_len=64, **kw)
        graphs = None
        if fake:
            graphs = llm.engine.runner.prefill_graphs = FakeGraphs(llm.engine.runner, 32)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        eng = llm.engine
        assert eng.allocator.num_free == eng.allocator.num_pages
        return [o.outputs[0].token_ids for o in outs], graphs, eng.scheduler.num_preemptions

    # 8 requests of ~40 tokens need ~80 pages of 4 at the end: 24 force preemption
    want, _, _ = run(False, num_pages=24, max_num_batched_tokens=24)
    got, graphs, pre = run(True, num_pages=24, max_num_batched_tokens=24)
    assert pre > 0 and got == want
    # prompt chunks of up to 24 tokens (bucket 32) and decode steps (bucket 16) replayed
    assert set(graphs.buckets_run) >= {16, 32}


def test_graph_link_starts():
    """Links of 1, g, g**2, ... layers (engine/graph_segments.py); one graph for growth 0."""
    from kvfit.engine.graph_segments import segment_starts

    assert segment_starts(28, 3) == [1, 4, 13]  # links of 1, 3, 9 and 15 layers
    assert segment_starts(28, 2) == [1, 3, 7, 15]
    assert segment_starts(28, 0) == [] and segment_starts(1, 3) == []
    assert segment_starts(2, 3) == [1] and segment_starts(4, 1) == [1, 2, 3]
    for n in range(1, 80):
        s = segment_starts(n, 3)
        assert s == sorted(set(s)) and all(0 < i < n for i in s)


def test_capture_segmented_cuts_before_the_chosen_layers(monkeypatch):
    """capture_segmented on CPU with a recording stand-in for CUDAGraph: each link's capture
    holds exactly its layers, links share the pool, replay runs them in order, and the cutting
    hooks are gone afterwards (also when the forward raises)."""
    import contextlib

    from kvfit.engine import graph_segments

    log: list = []

    class FakeGraph:
        count = 0

        def __init__(self):
            self.id = FakeGraph.count
            FakeGraph.count += 1

        def capture_begin(self, pool=None):
            log.append(("begin", self.id, pool))

        def capture_end(self):
            log.append(("end", self.id))

        def replay(self):
            log.append(("replay", self.id))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    class Layer(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, x):
            log.append(("layer", self.i))
            if x is None:
                raise RuntimeError("boom")
            return x + 1

    layers = torch.nn.ModuleList(Layer(i) for i in range(5))

    def forward(x=torch.zeros(1)):
        for layer in layers:
            x = layer(x)
        return x

    chain, out = graph_segments.capture_segmented(forward, layers, [1, 3], "pool", None)
    assert out.item() == 5 and len(chain) == 3
    assert log == [("begin", 0, "pool"), ("layer", 0), ("end", 0), ("begin", 1, "pool"),
                   ("layer", 1), ("layer", 2), ("end", 1), ("begin", 2, "pool"), ("layer", 3),
                   ("layer", 4), ("end", 2)]
    log.clear()
    chain.replay()
    assert log == [("replay", 0), ("replay", 1), ("replay", 2)]
    assert all(not layer._forward_pre_hooks for layer in layers)
    with pytest.raises(RuntimeError, match="boom"):
        graph_segments.capture_segmented(lambda: forward(None), layers, [2], "pool", None)
    assert log[-1][0] == "end"  # the open capture was ended
    assert all(not layer._forward_pre_hooks for layer in layers)
