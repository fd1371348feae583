"""The GEMV of small decode steps (kernels/gemv.py) on the GPU: against float64 products and the
unfused kernels at Qwen3-1.7B's layer shapes; each row's bits the same for every M and row
position (plain, fused norm + residual, gated, float32 LM head); and, through
models/decode_rows.py's GEMV path (``decode_gemv`` on), a tiny Llama's one-token logits close to
the batched path's, and request 0's bit-equal alone and in decode batches of up to 4 (the path's
row limit raised), eager and CUDA graph, per backend and KV dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvhelpers import DEV

pytestmark = pytest.mark.gpu
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # relative spacing, upper bound
SHAPES = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (100, 72)]  # (N, K)


def _within(y, ref, dtype, roundings):
    tol = roundings * ULP[dtype] * ref.abs() + 1e-4 * ref.abs().max()
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), (int(bad.sum()), y[bad][:4], ref[bad][:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64(dtype, n, k):
    from kvfit.kernels.gemv import gemv

    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype)
    y = gemv(x, w, b)
    _within(y, x.double() @ w.double().t() + b.double(), dtype, 1)
    # and with cuBLAS, as a whole: element-wise, two roundings are not guaranteed where the bias
    # cancels the product (the bf16 100 x 72 case failed in round B, its message cut off)
    ref = F.linear(x, w, b).double()
    assert (y.double() - ref).norm() <= ULP[dtype] * ref.norm()


@pytest.mark.parametrize("n,k,gated", [(4096, 2048, False), (12288, 2048, True),
                                       (48, 72, True)])
def test_fused_norm_and_act_match_unfused_kernels(n, k, gated):
    from kvfit.kernels.fused_act import act_and_mul
    from kvfit.kernels.fused_norm import fused_add_rms_norm
    from kvfit.kernels.gemv import gemv

    dtype = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    r = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    y, s = gemv(x, w, norm=(nw, 1e-6, 0.0), residual=r, gated_act="silu" if gated else None)
    h, s_ref = fused_add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(s, s_ref)  # the new residual, bit for bit
    assert y.shape == (1, n // 2 if gated else n)
    # the kernel's math in float64: W (w_norm * s) / rms(s)
    s64 = s.double()
    h64 = s64 * torch.rsqrt((s64 * s64).mean() + 1e-6) * nw.double()
    exact = h64 @ w.double().t()
    unfused = h.double() @ w.double().t()  # the unfused kernels round the normed input twice
    if gated:
        g, u = exact.chunk(2, dim=-1)
        exact = F.silu(g) * u
        unfused = act_and_mul(unfused.to(dtype), "silu").double()
        _within(y, exact, dtype, 4)
    else:
        _within(y, exact, dtype, 1)
    assert (y.double() - unfused).norm() <= 2 * ULP[dtype] * unfused.norm()



QWEN3 = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
         "down": (2048, 6144), "lm_head": (151936, 2048)}


@pytest.mark.parametrize("name", list(QWEN3))
@pytest.mark.parametrize("programs", [1, 132, 264, 1000])
def test_persistent_grid_gives_the_classic_bits(name, programs):
    """The persistent GEMV (config[4] blocks per program) computes each block as the one-program-
    per-block grid does, at every grid size (one program; the SMs; twice; most blocks alone),
    with the fused norm, residual and gated epilogue, M = 1 and 3."""
    from kvfit.kernels.gemv import gemv, gemv_config

    n, k = QWEN3[name]
    gated = "silu" if name == "gate_up" else None
    g = torch.Generator(device=DEV).manual_seed(11)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).bfloat16()
    n_out = n // 2 if gated else n
    for m in (1, 3):
        x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
        r = torch.randn(m, k, device=DEV, generator=g).bfloat16()
        tile = gemv_config(n_out, k, bool(gated), 1)[:4]
        blocks = -(-n_out // tile[0]) * m
        pers = tile + (-(-blocks // programs),)
        if name == "lm_head":
            fn = lambda t: [gemv(x, w, out_dtype=torch.float32, config=t)]  # noqa: E731
        elif name in ("qkv", "gate_up"):
            fn = lambda t: list(gemv(x, w, norm=(nw, 1e-6, 0.0), residual=r,  # noqa: E731
                                     gated_act=gated, config=t))
        else:
            fn = lambda t: [gemv(x, w, config=t)]  # noqa: E731
        classic, persistent = fn(tile), fn(pers)
        assert torch.isfinite(classic[0]).all()
        for a, b in zip(classic, persistent):
            assert torch.equal(a, b), (name, programs, m)


@pytest.mark.parametrize("name", list(QWEN3))
def test_rows_are_batch_invariant(name):
    """Row i of x[rows] has the bits it has alone, for M in 1..8 and rows in any order."""
    from kvfit.kernels.gemv import gemv

    n, k = QWEN3[name]
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(8, k, device=DEV, generator=g).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).bfloat16()
    r = torch.randn(8, k, device=DEV, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).bfloat16()
    if name == "lm_head":
        fn = lambda rows: gemv(x[rows], w, out_dtype=torch.float32)  # noqa: E731
    elif name in ("qkv", "gate_up"):
        gated = "silu" if name == "gate_up" else None
        fn = lambda rows: torch.cat(gemv(x[rows], w, norm=(nw, 1e-6, 0.0), residual=r[rows],  # noqa
                                         gated_act=gated), 1)
    else:
        fn = lambda rows: gemv(x[rows], w)  # noqa: E731
    alone = torch.cat([fn([i]) for i in range(8)])
    assert torch.isfinite(alone).all()
    for rows in ([0, 1], [2, 1, 0], [3, 0, 2, 1], [7, 6, 5, 4, 3, 2, 1, 0], list(range(5))):
        assert torch.equal(fn(rows), alone[rows]), rows


@pytest.mark.parametrize("backend", ["triton", "fi"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("graphed", [True, False])
def test_request_logits_on_the_gemv_path(backend, kv_dtype, graphed, monkeypatch):
    """``decode_gemv`` on: a one-token step's logits (the GEMV path) agree with the batched
    path's (cuBLAS) to within a few roundings; with the path's row limit raised to 4, request
    0's logits have the same bits alone and in decode batches of 2, 3 and 4 (contexts under 256
    tokens: one attention split in every batch), eager and from CUDA graphs."""
    from kvfit.models import decode_rows
    from test_cuda_graph import tiny_model
    from test_rows_gemm_cuda import _logits_by_batch

    monkeypatch.setattr(decode_rows, "ROWS_GEMM", False)
    monkeypatch.setattr(decode_rows, "GEMV_MAX_ROWS", 4)
    torch.manual_seed(0)
    cfg, model = tiny_model(128)
    prompts = [torch.randint(0, 512, (int(k),)).tolist() for k in torch.randint(5, 100, (4,))]
    tables = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(4)]  # 7 pages each, disjoint
    model.set_decode_gemv(False)
    ref = _logits_by_batch(model, cfg, backend, kv_dtype, prompts, tables, [1], graphed)[1]
    model.set_decode_gemv(True)
    got = _logits_by_batch(model, cfg, backend, kv_dtype, prompts, tables, [1, 2, 3, 4], graphed)
    assert torch.isfinite(got[1]).all()
    # two products' roundings (normed input unrounded, other sums) per layer, 2 layers
    assert (got[1] - ref).abs().max() <= 0.05 * ref.abs().max(), (got[1] - ref).abs().max()
    for bs in (2, 3, 4):
        assert torch.equal(got[bs], got[1]), (bs, (got[bs] - got[1]).abs().max().item())


def test_pdl_chain_in_a_graph_matches_eager(monkeypatch):
    """A chain of dependent GEMVs (the four products of two Qwen3-1.7B layers + the LM head)
    captured in a CUDA graph with programmatic dependent launch on (off by default, measured
    slower; kept as an option): every replay, fed a fresh input, gives the bits of the eager chain without PDL. A kernel
    that read its input before its predecessor finished would read the previous replay's
    values (other inputs), so the fresh input per replay is what catches a missing wait."""
    from kvfit.kernels import pdl
    from kvfit.kernels.gemv import gemv

    g = torch.Generator(device=DEV).manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=DEV, generator=g)).bfloat16()

    layers = [{name: rnd(*QWEN3[name], scale=QWEN3[name][1] ** -0.5)
               for name in ("qkv", "o", "gate_up", "down")} for _ in range(2)]
    norms = [(1 + rnd(2048, scale=0.1), 1 + rnd(2048, scale=0.1)) for _ in range(2)]
    lm_head = rnd(*QWEN3["lm_head"], scale=2048 ** -0.5)

    def chain(x):
        residual = None
        for w, (n_in, n_post) in zip(layers, norms):
            qkv, residual = gemv(x, w["qkv"], norm=(n_in, 1e-6, 0.0), residual=residual)
            h = gemv(qkv[:, :2048].contiguous(), w["o"])
            a, residual = gemv(h, w["gate_up"], norm=(n_post, 1e-6, 0.0), residual=residual,
                               gated_act="silu")
            x = gemv(a, w["down"])
        return gemv(x, lm_head, out_dtype=torch.float32)

    inputs = [rnd(1, 2048) for _ in range(3)]
    monkeypatch.setattr(pdl, "ENABLED", False)
    eager = [chain(x) for x in inputs]
    monkeypatch.setattr(pdl, "ENABLED", True)
    if not pdl.launch_options(torch.device(DEV))["PDL"]:
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    static_x = inputs[0].clone()
    chain(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x)
    for x, ref in zip(inputs[1:] + inputs[:1], eager[1:] + eager[:1]):
        out.fill_(float("nan"))  # poisoned: a replay that skips the LM head is caught too
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
