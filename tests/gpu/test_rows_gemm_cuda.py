"""Batch invariance of the decode step on the GPU through the opt-in tensor-core path
(kernels/rows_gemm.py, models/decode_rows.py; the default GEMV path: test_gemv_cuda.py):
rows_gemm against float64 at Qwen3-1.7B's layer shapes; each row's bits the same for every
batch size across the tile buckets (plain, fused norm/gated, float32 LM head); and a tiny
Llama's logits of request 0 bit-equal alone and inside decode batches of 2, 3, 8 and
``decode_rows.MAX_ROWS`` (and 33 with MAX_ROWS = 64), eager and CUDA graph, per backend and KV
dtype."""

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


def _logits_by_batch(model, cfg, backend, kv_dtype, prompts, tables, batches, graphed):
    """Prefill every request alone, then for each batch size bs one decode step of the first bs
    requests (each step writes the same K/V: same token at the same position); request 0's
    float32 logits per batch size."""
    from kvfit.engine.cuda_graph import DecodeGraphs

    ps = 16
    num_pages = max(256, 1 + max(max(t) for t in tables))
    ctx = make_backend(backend, cfg, model, kv_dtype, num_pages, ps)
    out = {}
    with torch.inference_mode():
        for p, t in zip(prompts, tables):
            ctx.backend.prepare(build_metadata([len(p)], [len(p)], [t], ps, DEV))
            model(torch.tensor(p, device=DEV), torch.arange(len(p), device=DEV), ctx)
        graphs = DecodeGraphs(model, ctx, max(batches), 12, DEV) if graphed else None
        for bs in batches:
            lens = [len(p) + 1 for p in prompts[:bs]]
            toks = torch.tensor([(7 * i) % 500 for i in range(bs)], device=DEV)
            pos = torch.tensor([n - 1 for n in lens], device=DEV)
            if graphs is not None:
                hidden = graphs.run(toks, pos, lens, tables[:bs])
            else:
                ctx.backend.prepare(build_metadata([1] * bs, lens, tables[:bs], ps, DEV))
                hidden = model(toks, pos, ctx)
            out[bs] = model.compute_logits(hidden)[0].clone()
    return out


@pytest.mark.parametrize("backend", ["triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("graphed", [True, False])
@pytest.mark.parametrize("max_rows", [None, 64])  # the default, and every tile bucket to 64
def test_request_logits_are_batch_invariant(backend, kv_dtype, graphed, max_rows, monkeypatch):
    """Request 0's logits: the same bits alone and in decode batches of 2, 3, 8 and up to
    ``decode_rows.MAX_ROWS`` (its context under 256 tokens: one attention split in every
    batch); with MAX_ROWS = 64 also in a batch of 33 (other rows_gemm tiles)."""
    from kvfit.models import decode_rows

    monkeypatch.setattr(decode_rows, "ROWS_GEMM", True)  # off by default (see decode_rows)
    if max_rows is not None:
        monkeypatch.setattr(decode_rows, "MAX_ROWS", max_rows)
    torch.manual_seed(0)
    cfg, model = tiny_model(128)
    top = decode_rows.MAX_ROWS
    n = max(33, top)  # a prompt for every row of the largest batch
    prompts = [torch.randint(0, 512, (int(k),)).tolist() for k in torch.randint(5, 100, (n,))]
    tables = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(n)]  # 7 pages each, disjoint
    batches = sorted({1, 2, 3, 8, top} | ({33} if top >= 33 else set()))
    got = _logits_by_batch(model, cfg, backend, kv_dtype, prompts[:max(batches)], tables,
                           batches, graphed)
    assert torch.isfinite(got[1]).all()
    for bs in batches[1:]:
        assert torch.equal(got[bs], got[1]), (bs, (got[bs] - got[1]).abs().max().item())
