"""Batch invariance of the decode step on the GPU (kernels/rows_gemm.py, models/decode_rows.py):
rows_gemm against float64 at Qwen3-1.7B's layer shapes; each row's bits the same for every
batch size (plain, fused norm/gated, float32 LM head); and a tiny Llama's logits of request 0
bit-equal alone and inside decode batches of 2, 3, 8 and 33 (eager and CUDA graph, per backend
and KV dtype)."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata

from kvhelpers import DEV
from test_cuda_graph import make_backend, tiny_model

pytestmark = pytest.mark.gpu
QWEN3 = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
         "down": (2048, 6144), "lm_head": (151936, 2048)}
MS = (1, 2, 3, 8, 33, 64, 256)


def _rand(*shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g)


@pytest.mark.parametrize("name", list(QWEN3))
def test_rows_gemm_matches_float64(name):
    from kvfit.kernels.rows_gemm import rows_gemm

    n, k = QWEN3[name]
    x = _rand(64, k, seed=1).bfloat16()
    w = (_rand(n, k, seed=2) / k ** 0.5).bfloat16()
    ref = x.double() @ w.double().t()
    y = rows_gemm(x, w, out_dtype=torch.float32 if name == "lm_head" else None)
    tol = 2.0 ** -7 * ref.abs() + 1e-4 * ref.abs().max()  # one rounding of the output
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), (int(bad.sum()), y[bad][:4], ref[bad][:4])


@pytest.mark.parametrize("name", list(QWEN3))
def test_rows_are_batch_invariant(name):
    """Row i of x[:M] has the same bits for every M, through every variant the layer uses."""
    from kvfit.kernels.rows_gemm import rows_gemm

    n, k = QWEN3[name]
    x = _rand(max(MS), k, seed=3).bfloat16()
    w = (_rand(n, k, seed=4) / k ** 0.5).bfloat16()
    r = _rand(max(MS), k, seed=5).bfloat16()
    nw = (1 + 0.1 * _rand(k, seed=6)).bfloat16()
    if name == "lm_head":
        fn = lambda m: rows_gemm(x[:m], w, out_dtype=torch.float32)  # noqa: E731
    elif name in ("qkv", "gate_up"):
        gated = "silu" if name == "gate_up" else None
        fn = lambda m: torch.cat(rows_gemm(x[:m], w, norm=(nw, 1e-6, 0.0), residual=r[:m],  # noqa
                                           gated_act=gated), 1)
    else:
        fn = lambda m: rows_gemm(x[:m], w)  # noqa: E731
    full = fn(max(MS))
    assert torch.isfinite(full).all()
    for m in MS:
        assert torch.equal(fn(m), full[:m]), m


def _decode_logits(model, cfg, backend, kv_dtype, prompts, tables, bs, graphs_max):
    """Prefill every request alone (the same K/V in every run), then one decode step of the
    first ``bs`` requests; returns request 0's float32 logits."""
    from kvfit.engine.cuda_graph import DecodeGraphs

    ps = 16
    ctx = make_backend(backend, cfg, model, kv_dtype, 256, ps)
    with torch.inference_mode():
        for p, t in zip(prompts[:bs], tables[:bs]):
            ctx.backend.prepare(build_metadata([len(p)], [len(p)], [t], ps, DEV))
            model(torch.tensor(p, device=DEV), torch.arange(len(p), device=DEV), ctx)
        lens = [len(p) + 1 for p in prompts[:bs]]
        toks = torch.tensor([(7 * i) % 500 for i in range(bs)], device=DEV)
        pos = torch.tensor([n - 1 for n in lens], device=DEV)
        if graphs_max:
            graphs = DecodeGraphs(model, ctx, graphs_max, 12, DEV)
            hidden = graphs.run(toks, pos, lens, tables[:bs])
        else:
            ctx.backend.prepare(build_metadata([1] * bs, lens, tables[:bs], ps, DEV))
            hidden = model(toks, pos, ctx)
        return model.compute_logits(hidden)[0].clone()


@pytest.mark.parametrize("backend", ["triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("graphed", [False, True])
def test_request_logits_are_batch_invariant(backend, kv_dtype, graphed):
    """Request 0's logits: the same bits alone and in decode batches of 2, 3, 8 and 33 (its
    context under 256 tokens: one attention split in every batch)."""
    from kvfit.models import decode_rows

    assert decode_rows.ENABLED  # the default
    torch.manual_seed(0)
    cfg, model = tiny_model(128)
    prompts = [torch.randint(0, 512, (int(n),)).tolist()
               for n in torch.randint(5, 100, (33,))]
    tables = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(33)]  # 7 pages each, disjoint
    alone = _decode_logits(model, cfg, backend, kv_dtype, prompts, tables, 1, 40 * graphed)
    assert torch.isfinite(alone).all()
    for bs in (2, 3, 8, 33):
        got = _decode_logits(model, cfg, backend, kv_dtype, prompts, tables, bs, 40 * graphed)
        assert torch.equal(got, alone), (bs, (got - alone).abs().max().item())
