"""The triton backend over the MLA latent pool on the GPU: the kernels against the float64
reference (DeepSeek-V2-Lite and V2 head shapes, every latent format, pages of 16 and 32, split
decode, mixed prefill/extend batches), the fp8 latent store bit-exact with
``kvcache.quant.quantize``, the tiny DeepSeek-V2 through the triton backend against HF (float32)
and against the torch backend (bf16 compute, every format), and CUDA-graph decode (grouped-GEMM
MoE, graph kernels) against eager decode."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mla_kernel_ref import mla_reference, random_latent_batch  # noqa: E402
from modelhelpers import chunked_schedule, random_sequences  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2"]
# relative to the output's largest entry: bf16 output rounding; fp8 latents are exact inputs of
# the reference (it reads the stored values), so only the 16-bit query/probability rounding
TOL = {"bfloat16": 1.5e-2, "fp8_e4m3": 2e-2, "fp8_e5m2": 2e-2}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# every format, both page sizes, V2-Lite's 16 heads and V2's 128 (two programs per request),
# without the full cross product (each combination is one more Triton compile)
@pytest.mark.parametrize("fmt,page,heads", [("bfloat16", 16, 16), ("fp8_e4m3", 32, 16),
                                            ("fp8_e5m2", 16, 128), ("bfloat16", 32, 128),
                                            ("fp8_e4m3", 16, 16)])
def test_mla_decode_kernel(fmt, page, heads):
    from kvfit.kernels.mla import decode_config, mla_decode

    kv_lens = [3000, 17, 513, 1]
    q, cache, table, cu, kv, stored = random_latent_batch([1] * 4, kv_lens, heads, 512, 64,
                                                          page, fmt, DEV, seed=heads + page,
                                                          scale=0.5)
    sm = 192 ** -0.5
    cfg = decode_config(4, heads, 512, max(kv_lens), cache.dtype, q.dtype)
    assert cfg.num_splits > 1  # 4 requests on 132 SMs: the context is split
    out = torch.full((4, heads, 512), float("nan"), dtype=q.dtype, device=DEV)
    mla_decode(q, cache, table, cu, kv, out, 512, sm, cfg, scale=0.5)
    assert _rel(out, mla_reference(q, stored, [1] * 4, kv_lens, 512, sm)) < TOL[fmt]


@pytest.mark.parametrize("fmt,page", [("bfloat16", 16), ("fp8_e4m3", 32), ("fp8_e5m2", 16),
                                      ("bfloat16", 32)])
def test_mla_prefill_kernel(fmt, page):
    from kvfit.kernels.mla import mla_prefill, order_mla_blocks, prefill_config

    heads = 16
    q_lens, kv_lens = [300, 1, 77, 5], [300, 900, 1100, 5]  # prompt, decode, extension, short
    q, cache, table, cu, kv, stored = random_latent_batch(q_lens, kv_lens, heads, 512, 64, page,
                                                          fmt, DEV, seed=page)
    cfg = prefill_config(heads, cache.dtype, q.dtype)
    blocks = order_mla_blocks(q_lens, kv_lens, heads, cfg.block_m, DEV)
    out = torch.full((sum(q_lens), heads, 512), float("nan"), dtype=q.dtype, device=DEV)
    mla_prefill(q, cache, table, cu, kv, blocks, out, 512, 0.1, cfg)
    assert _rel(out, mla_reference(q, stored, q_lens, kv_lens, 512, 0.1)) < TOL[fmt]


@pytest.mark.parametrize("fmt,scale", [("fp8_e4m3", 0.5), ("fp8_e5m2", 1.0), ("bfloat16", 1.0),
                                       ("fp8_e4m3", 3.0)])
def test_store_latent_bit_exact_cuda(fmt, scale):
    from kvfit.kernels.mla import store_latent
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.quant import quantize

    f = kv_format(fmt)
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(300, 576, generator=g) * 100).to(torch.bfloat16).to(DEV)
    kv[0, :2] = torch.tensor([1e6, -1e6])  # saturates
    cache = torch.full((20, 16, 576), float("nan"), device=DEV).to(f.torch_dtype)
    slots = torch.randperm(320, generator=g)[:300].to(DEV)
    slots[7] = -1
    store_latent(kv, cache, slots, f, scale)
    want = quantize(kv, f, scale)
    flat = cache.view(-1, 576)
    keep = slots >= 0
    got = flat[slots[keep]]
    assert torch.equal(got.view(torch.uint8) if f.itemsize == 1 else got,
                       want[keep].view(torch.uint8) if f.itemsize == 1 else want[keep])


def _drive(ours, cfg, seqs, sched, backend, **kw):
    import test_mla as tm

    return tm.drive_mla(ours, cfg, seqs, sched, device=DEV, backend_name=backend, **kw)[0]


def test_tiny_deepseek_triton_float32_matches_hf():
    import test_mla as tm

    cfg, hf, ours = tm._hf_and_ours("lite")
    seqs = random_sequences(cfg, [11, 6], 16)
    got = _drive(ours.to(DEV), cfg, seqs, chunked_schedule([11, 6], 4, 16), "triton")
    hf = hf.to(DEV)
    for seq, g in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device=DEV)).logits[0].float()
        assert ((g - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_deepseek_triton_matches_torch_backend(fmt):
    import test_mla as tm

    cfg, _, ours = tm._hf_and_ours("v2")
    model = ours.to(DEV).to(torch.bfloat16)
    seqs = random_sequences(cfg, [19, 6, 9], 12)
    sched = chunked_schedule([19, 6, 9], 5, 12)
    kw = dict(kv_dtype=fmt, compute_dtype=torch.bfloat16)
    ref = _drive(model, cfg, seqs, sched, "torch", **kw)
    got = _drive(model, cfg, seqs, sched, "triton", **kw)
    for r, g in zip(ref, got):
        assert torch.isfinite(g).all()
        assert ((g - r).abs().max() / r.abs().max()).item() < 0.03


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3"])
def test_mla_cuda_graph_decode_matches_eager(fmt):
    """DecodeGraphs over the tiny DeepSeek-V2 (triton MLA kernels, grouped-GEMM MoE): the
    replayed logits equal eager decode's on the same tokens, for a batch padded up to a
    captured size."""
    import test_mla as tm

    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.engine.context import Context
    from kvfit.engine.cuda_graph import DecodeGraphs
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.mla import MLAKVCache

    cfg, _, ours = tm._hf_and_ours("lite")
    model = ours.to(DEV).to(torch.bfloat16)
    model.prepare_for_inference()
    page, n_pages = 16, 64
    layers = model.kv_layer_specs(cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (30, 9, 17)]
    steps = 6
    feed = torch.randint(0, cfg.vocab_size, (steps, 3), generator=g).to(DEV)
    tables = [[3 * j + i for j in range(4)] for i in range(3)]

    def run(graphs_on: bool):
        pool = MLAKVCache(layers, n_pages, page, kv_format(fmt), torch.device(DEV))
        be = TritonBackend(pool, torch.bfloat16, model.sm_scale(cfg))
        ctx = Context(be, pool, torch.bfloat16)
        graphs = DecodeGraphs(model, ctx, 4, 4, DEV) if graphs_on else None
        lens = [len(p) for p in prompts]
        with torch.inference_mode():
            be.prepare(build_metadata(lens, lens, tables, page, DEV))
            ids = torch.tensor(sum(prompts, []), device=DEV)
            pos = torch.tensor([i for p in prompts for i in range(len(p))], device=DEV)
            model(ids, pos, ctx)
            out = []
            for s in range(steps):
                lens = [n + 1 for n in lens]
                pos = torch.tensor([n - 1 for n in lens], device=DEV)
                if graphs is None:
                    be.prepare(build_metadata([1] * 3, lens, tables, page, DEV))
                    hidden = model(feed[s], pos, ctx)
                else:
                    hidden = graphs.run(feed[s], pos, lens, tables)
                out.append(model.compute_logits(hidden).clone())
        return torch.stack(out)

    eager, replay = run(False), run(True)
    assert torch.isfinite(replay).all()
    rel = ((replay - eager).abs().max() / eager.abs().max()).item()
    assert rel < 2e-2, rel


def test_engine_tiny_deepseek_triton_graphs_match_hf(tmp_path):
    """kvfit.LLM on CUDA with the triton backend and decode CUDA graphs (float32: the exact
    kernel path, MoE captured as every expert masked): every greedy token is HF's argmax."""
    import test_mla as tm

    _, hf, prompts, outs, llm = tm.engine_greedy(tmp_path, "lite", 4, DEV, dtype="float32",
                                                 attention_backend="triton",
                                                 cuda_graph_max_bs=4)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.pool.name == "MLAKVCache"
    for p, toks in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks], device=DEV)).logits[0].float()
        assert ref[len(p) - 1:-1].argmax(-1).tolist() == toks
