"""The fi backend over the MLA latent pool on the GPU (FlashInfer's MLA kernels: FA3 on Hopper):
the backend's steps against the float64 reference over the stored slabs (bf16 and fp8_e4m3
latents, pages of 16 and 32, a prompt batch, a mixed extend + decode step, a decode step),
CUDA-graph decode against eager decode (a padded batch), a tiny DeepSeek-V2 with DeepSeek's
512 + 64 slab against the torch backend, and the engine with decode graphs against HF."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kvhelpers import random_tables  # noqa: E402
from mla_kernel_ref import mla_reference  # noqa: E402
from modelhelpers import chunked_schedule, random_sequences  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
HEADS, SM = 16, 192 ** -0.5
# relative to the output's largest entry (as tests/gpu/test_mla_triton.py): bf16 rounding of
# the query, probabilities and output; fp8 latents are exact inputs of the reference
TOL = {"bfloat16": 1.5e-2, "fp8_e4m3": 2e-2}


def _fi():
    return pytest.importorskip("flashinfer")


def _backend(fmt, page, num_pages=160, scale=1.0):
    from kvfit.attention.flashinfer_backend import FlashInferBackend
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.mla import MLAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    _fi()
    pool = MLAKVCache([KVLayerSpec("mla", 1, 576)], num_pages, page, kv_format(fmt),
                      torch.device(DEV), k_scales=[scale])
    for c in pool.kv_caches:  # poison: a read of an unwritten slot shows up
        c.fill_(float("nan"))
    return pool, FlashInferBackend(pool, torch.bfloat16, SM)


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt,page,scale", [("bfloat16", 16, 1.0), ("fp8_e4m3", 32, 1.0),
                                            ("bfloat16", 32, 1.0), ("fp8_e4m3", 16, 0.5)])
def test_fi_mla_steps_match_reference(fmt, page, scale):
    from kvfit.attention.meta_builder import build_metadata

    pool, be = _backend(fmt, page, scale=scale)
    final = [341, 79, 7]
    tables = random_tables([n + page for n in final], page, pool.num_pages, seed=page)
    g = torch.Generator().manual_seed(3)
    steps = [([300, 77, 5], [300, 77, 5]),  # prompts
             ([40, 1, 1], [340, 78, 6]),  # an extension and two decodes (mixed)
             ([1, 1, 1], [341, 79, 7])]  # decode
    for q_lens, kv_lens in steps:
        t = sum(q_lens)
        q = torch.randn(t, HEADS, 576, generator=g).to(torch.bfloat16).to(DEV)
        kv = (torch.randn(t, 576, generator=g) * 2.0).to(torch.bfloat16).to(DEV)
        meta = build_metadata(q_lens, kv_lens, tables, page, DEV)
        be.prepare(meta)
        out = be.forward_mla(q, kv, 0, 512)
        assert out.shape == (t, HEADS, 512) and torch.isfinite(out).all()
        stored = [pool.gather_latent(0, torch.tensor(tab, device=DEV), n, torch.float64).cpu()
                  for tab, n in zip(tables, kv_lens)]
        rel = _rel(out, mla_reference(q, stored, q_lens, kv_lens, 512, SM))
        assert rel < TOL[fmt], (q_lens, rel)


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3"])
def test_fi_mla_graph_decode_matches_eager(fmt):
    """Decode steps replayed from a graph captured for 4 rows (3 requests + a padding row:
    q_len 1, kv_len 1, page 0, nothing stored), re-planned before each replay, against the
    same steps run eagerly on a second pool."""
    from kvfit.attention.meta_builder import build_metadata

    page, steps = 16, 4
    prompt = [50, 20, 33]
    tables = random_tables([n + steps for n in prompt], page, 160, seed=7)
    g = torch.Generator().manual_seed(5)
    pre_q = torch.randn(sum(prompt), HEADS, 576, generator=g).to(torch.bfloat16).to(DEV)
    pre_kv = (torch.randn(sum(prompt), 576, generator=g) * 2).to(torch.bfloat16).to(DEV)
    qs = [torch.randn(3, HEADS, 576, generator=g).to(torch.bfloat16).to(DEV)
          for _ in range(steps)]
    kvs = [(torch.randn(3, 576, generator=g) * 2).to(torch.bfloat16).to(DEV)
           for _ in range(steps)]

    static_slots = torch.empty(4, dtype=torch.int64, device=DEV)

    def decode_meta(lens, pad):
        if not pad:
            return build_metadata([1] * 3, lens, tables, page, DEV)
        # a graph reads the slots it was captured with: a static buffer, as DecodeGraphs keeps
        meta = build_metadata([1] * 4, lens + [1], tables + [[0]], page, DEV)
        static_slots.copy_(meta.slot_mapping)
        static_slots[3] = -1  # the padding row stores nothing
        return dataclasses.replace(meta, slot_mapping=static_slots)

    def run(graphs):
        pool, be = _backend(fmt, page)
        be.prepare(build_metadata(prompt, prompt, tables, page, DEV))
        be.forward_mla(pre_q, pre_kv, 0, 512)
        lens, outs = list(prompt), []
        if graphs:
            be.num_q_heads = HEADS
            be.init_cuda_graph(4, max(len(t) for t in tables))
            q_in = torch.zeros(4, HEADS, 576, dtype=torch.bfloat16, device=DEV)
            kv_in = torch.zeros(4, 576, dtype=torch.bfloat16, device=DEV)
            graph = None
        for s in range(steps):
            lens = [n + 1 for n in lens]
            if not graphs:
                be.prepare(decode_meta(lens, False))
                outs.append(be.forward_mla(qs[s], kvs[s], 0, 512))
                continue
            be.prepare_cuda_graph(decode_meta(lens, True))
            q_in[:3], kv_in[:3] = qs[s], kvs[s]
            if graph is None:  # warm up (this step's store and attention), then capture
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    be.forward_mla(q_in, kv_in, 0, 512)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out_static = be.forward_mla(q_in, kv_in, 0, 512)
            graph.replay()
            outs.append(out_static[:3].clone())
        torch.cuda.synchronize()
        return torch.stack(outs)

    eager, replay = run(False), run(True)
    assert torch.isfinite(replay).all()
    rel = ((replay.float() - eager.float()).abs().max() / eager.float().abs().max()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3"])
def test_tiny_deepseek_slab576_fi_matches_torch_backend(fmt):
    import test_mla as tm

    _fi()
    cfg, _, ours = tm._hf_and_ours("slab576", seed=1)
    model = ours.to(DEV).to(torch.bfloat16)
    seqs = random_sequences(cfg, [19, 6, 9], 12)
    sched = chunked_schedule([19, 6, 9], 5, 12)
    kw = dict(kv_dtype=fmt, compute_dtype=torch.bfloat16, device=DEV)
    ref = tm.drive_mla(model, cfg, seqs, sched, backend_name="torch", **kw)[0]
    got = tm.drive_mla(model, cfg, seqs, sched, backend_name="fi", **kw)[0]
    for r, g in zip(ref, got):
        assert torch.isfinite(g).all()
        assert ((g - r).abs().max() / r.abs().max()).item() < 0.03


def test_engine_slab576_fi_graphs_near_hf_argmax(tmp_path):
    """kvfit.LLM on CUDA with ``--attention-backend fi`` (bf16, decode CUDA graphs): every greedy
    token is within 0.05 nats of HF's float32 argmax at its position (bf16 may flip exact
    near-ties, a wrong kernel does not stay this close)."""
    import test_mla as tm

    _fi()
    _, hf, prompts, outs, llm = tm.engine_greedy(tmp_path, "slab576", 4, DEV, dtype="bfloat16",
                                                 attention_backend="fi", cuda_graph_max_bs=4)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.pool.name == "MLAKVCache"
    for p, toks in zip(prompts, outs):
        with torch.no_grad():
            logp = hf(torch.tensor([p + toks], device=DEV)).logits[0].float().log_softmax(-1)
        rows = logp[len(p) - 1:-1]  # [12, vocab]
        chosen = rows.gather(1, torch.tensor(toks, device=DEV)[:, None])[:, 0]
        gap = (rows.max(-1).values - chosen).max().item()
        assert gap < 0.05, (toks, gap)
