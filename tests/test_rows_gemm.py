"""The batch-invariant small GEMM (kernels/rows_gemm.py) on the CPU under the Triton interpreter:
against float64 references on small shapes (plain, bias, float32 out, the residual-add + RMSNorm
prologue, the gated epilogue, K not a multiple of the tile), each row's bits the same for every
batch size, bad input refused; and models/decode_rows.py wired into a tiny Llama: a decode step
of one and of three rows gives the batched path's hidden states and K/V to within a few
roundings, and the first row's bits do not change with the batch.

float16 is compared at one rounding per product (the interpreter rounds float16 like the GPU);
its dot runs in float32 (models/rows_gemm: F32_DOT), the GPU's on the tensor cores."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():  # the interpreter flag is process-wide: never set it next to a GPU
    pytest.skip("Triton-interpreter tests run on CPU-only machines; the GPU runs "
                "tests/gpu/test_rows_gemm_cuda.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvfit.kernels.rows_gemm import rows_gemm  # noqa: E402

DT = torch.float16
ULP = 2.0 ** -10
TILE = (16, 16, 32, 4, 1)
SWAPPED = (16, 16, 32, 4, 1, 1)  # W_tile @ x_tile^T
SPLIT3 = (16, 16, 32, 4, 1, 0, 3)  # K in three ranges, partials added by the last program


def _close(y, ref, roundings=1.0):
    tol = roundings * ULP * ref.abs() + 1e-3 * ref.abs().max()
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), (y[bad][:5], ref[bad][:5])


def _data(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DT)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DT)
    return x, w, g


@pytest.mark.parametrize("tile", [TILE, SWAPPED, SPLIT3])
@pytest.mark.parametrize("m,k", [(3, 96), (18, 80)])  # 80: K not a multiple of the tile
def test_plain_bias_and_float32_out(m, k, tile):
    x, w, g = _data(m, k, 20, 1)  # 20 columns: the last column block is partial
    bias = torch.randn(20, generator=g).to(DT)
    y = rows_gemm(x, w, config=tile)
    assert y.shape == (m, 20) and y.dtype == DT
    _close(y, x.double() @ w.double().t())
    yb = rows_gemm(x, w, bias, config=tile)
    _close(yb, x.double() @ w.double().t() + bias.double())
    y32 = rows_gemm(x, w, out_dtype=torch.float32, config=tile)
    assert y32.dtype == torch.float32 and torch.equal(y32, y.float())


@pytest.mark.parametrize("tile", [TILE, SWAPPED, SPLIT3])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_prologue_and_gated_epilogue(gated, tile):
    m, k, n = 5, 64, 32
    x, w, g = _data(m, k, n, 2)
    res = torch.randn(m, k, generator=g).to(DT)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DT)
    y, s = rows_gemm(x, w, norm=(nw, 1e-6, 0.0), residual=res,
                     gated_act="silu" if gated else None, config=tile)
    assert torch.equal(s, x + res)  # the new residual, rounded like torch's add
    s64 = s.double()
    h = s64 * torch.rsqrt((s64 * s64).mean(-1, keepdim=True) + 1e-6) * nw.double()
    exact = h @ w.double().t()
    if gated:
        gate, up = exact.chunk(2, dim=-1)
        exact = F.silu(gate) * up
        assert y.shape == (m, n // 2)
    _close(y, exact, 4.0 if gated else 2.0)  # + the normed input's rounding before the dot
    y0, s0 = rows_gemm(x, w, norm=(nw, 1e-6, 1.0), config=tile)  # offset, no residual
    assert s0 is x
    h0 = x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) \
        * (1.0 + nw.double())
    _close(y0, h0 @ w.double().t(), 2.0)


@pytest.mark.parametrize("tile", [TILE, SWAPPED, SPLIT3])
def test_rows_do_not_depend_on_the_batch(tile):
    """Row i of x[:M] has the same bits for every M (one tile for every M), plain and fused."""
    k, n = 48, 40
    x, w, g = _data(20, k, n, 3)
    res = torch.randn(20, k, generator=g).to(DT)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DT)
    full = rows_gemm(x, w, config=tile)
    fused, s_full = rows_gemm(x, w, norm=(nw, 1e-6, 0.0), residual=res, gated_act="silu",
                              config=tile)
    for m in (1, 2, 3, 17):  # 17: a second row block
        assert torch.equal(rows_gemm(x[:m], w, config=tile), full[:m])
        y, s = rows_gemm(x[:m], w, norm=(nw, 1e-6, 0.0), residual=res[:m], gated_act="silu",
                         config=tile)
        assert torch.equal(y, fused[:m]) and torch.equal(s, s_full[:m])
    if tile == SPLIT3:  # every tile's last program reset its counter for the next launch
        from kvfit.kernels.rows_gemm import _COUNTERS

        assert not _COUNTERS[x.device].any()


def test_bad_input_is_refused():
    x = torch.randn(2, 16).half()
    w = torch.randn(8, 16).half()
    with pytest.raises(ValueError, match="16-bit rows"):
        rows_gemm(x, w.float())
    with pytest.raises(ValueError, match="16-bit rows"):
        rows_gemm(x[:, :8], w)
    with pytest.raises(ValueError, match="even row count"):
        rows_gemm(x, w[:7], gated_act="silu")
    with pytest.raises(ValueError, match="float32, not"):
        rows_gemm(x, w, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        rows_gemm(x, w, norm=(torch.ones(8).half(), 1e-6, 0.0))
    with pytest.raises(ValueError, match="residual"):
        rows_gemm(x, w, norm=(torch.ones(16).half(), 1e-6, 0.0), residual=x[:1])


@pytest.mark.parametrize("path", ["rows_gemm", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_rows_layer_path_equals_the_batched_path(monkeypatch, dtype, path):
    """models/decode_rows.py wired into a tiny Llama on the CPU (the products interpreted, the
    torch attention backend), through the tensor-core rows path and the default GEMV path: a
    decode step of 1 and of 3 requests gives the batched path's hidden states to within a few
    roundings and stores the same K/V; request 0's hidden state and logits have the same bits
    alone and batched."""
    from transformers import LlamaConfig

    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.torch_ref import TorchRefBackend
    from kvfit.engine.context import Context
    from kvfit.kernels import gemv as gemv_mod
    from kvfit.kernels import rows_gemm as rows_mod
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.models import decode_rows
    from kvfit.models.llama import LlamaForCausalLM
    from kvfit.models.weights import init_dummy

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, 64).to(dtype).eval()
    with torch.no_grad():
        init_dummy(model, 0)
        for layer in model.model.layers:  # non-trivial norm weights
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1.0, 0.2)
    prompts = [[5, 17, 3, 44, 9, 60], [8, 2, 33], [70, 71, 72, 73, 74]]
    tables = [[2, 5], [1], [3, 4]]

    def run(rows_on: bool, nreq: int):
        pool = MHAKVCache(model.kv_layer_specs(cfg), 8, 4, kv_format(str(dtype)[6:]), "cpu")
        ctx = Context(TorchRefBackend(pool, dtype, model.sm_scale(cfg)), pool, dtype)
        ps, ts = prompts[:nreq], tables[:nreq]
        with torch.inference_mode(), monkeypatch.context() as m:
            model.set_decode_gemv(False)  # the prompts: batched path, both runs
            m.setattr(decode_rows, "ROWS_GEMM", False)
            lens = [len(p) for p in ps]
            ctx.backend.prepare(build_metadata(lens, lens, ts, 4, "cpu"))
            model(torch.tensor(sum(ps, [])), torch.cat([torch.arange(n) for n in lens]), ctx)
            if rows_on:  # the GPU path's dispatch, on the CPU under the interpreter
                mod = rows_mod if path == "rows_gemm" else gemv_mod
                m.setattr(mod, "supports", mod.fits)
            m.setattr(decode_rows, "ROWS_GEMM", rows_on and path == "rows_gemm")
            # the GEMV's rows are invariant for any M (one program per row); the engine's
            # limit of one row is a speed choice: three rows here exercise the invariance
            m.setattr(decode_rows, "GEMV_MAX_ROWS", 3)
            model.set_decode_gemv(rows_on and path == "gemv")
            assert decode_rows.path_of(model.model.layers[0], torch.zeros(nreq, 64, dtype=dtype),
                                       torch.zeros(nreq, 64, dtype=dtype)) == (
                path if rows_on else None)
            ctx.backend.prepare(build_metadata([1] * nreq, [n + 1 for n in lens], ts, 4, "cpu"))
            hidden = model(torch.tensor([11, 12, 13][:nreq]), torch.tensor(lens), ctx)
            logits = model.compute_logits(hidden)
        return hidden, logits, pool.k_caches[0][5, :, 2].double()

    h_ref, l_ref, k_ref = run(False, 3)
    h, lg, k = run(True, 3)
    ulp = 8 * (ULP if dtype == torch.float16 else 2.0 ** -7)  # a few roundings
    assert (h.double() - h_ref.double()).abs().max() <= ulp * h_ref.abs().max()
    assert (lg.double() - l_ref.double()).abs().max() <= ulp * l_ref.abs().max()
    assert (k - k_ref).abs().max() <= ulp * k_ref.abs().max()
    h1, l1, _ = run(True, 1)
    assert torch.equal(h1[0], h[0]) and torch.equal(l1[0], lg[0])


def test_norm_sum_of_squares_same_for_every_block_k():
    """The norm prologue chains 64-column trees whatever the tile's block_k (64, 128, 256): with
    a selection matrix as the weight (every dot exact in any order), the outputs of the three
    tiles are the same bits, and they match float64."""
    m, k, n = 6, 512, 32
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(m, k, generator=g)).to(DT)
    res = torch.randn(m, k, generator=g).to(DT)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DT)
    w = torch.zeros(n, k, dtype=DT)
    w[torch.arange(n), torch.randperm(k, generator=g)[:n]] = 1.0
    outs = []
    for bk in (64, 128, 256):
        y, s = rows_gemm(x, w, norm=(nw, 1e-6, 0.0), residual=res, config=(16, 16, bk, 4, 1),
                         out_dtype=torch.float32)
        outs.append(y)
    s64 = s.double()
    h = (s64 * nw.double()).to(DT).double()  # the normed input is rounded before the dot
    exact = h @ w.double().t() * torch.rsqrt((s64 * s64).mean(-1, keepdim=True) + 1e-6)
    _close(outs[0], exact, 2.0)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="block_k"):
        rows_gemm(x, w, norm=(nw, 1e-6, 0.0), config=(16, 16, 512, 4, 1))


def test_decode_gemv_flag_resolves_and_reaches_every_layer():
    """``--decode-gemv``: auto is on only where no step batches requests (max_num_seqs = 1: the
    GEMV path's bits differ from the batched path's), on/off force it, anything else is refused;
    ``set_decode_gemv`` flags the model and every layer (what the runner calls before capture)."""
    import argparse

    from transformers import LlamaConfig

    from kvfit.config import add_engine_args, make_config
    from kvfit.models.llama import LlamaForCausalLM

    assert not make_config(device="cpu").resolved_decode_gemv
    assert make_config(device="cpu", max_num_seqs=1).resolved_decode_gemv
    assert make_config(device="cpu", decode_gemv="on").resolved_decode_gemv
    assert not make_config(device="cpu", max_num_seqs=1, decode_gemv="off").resolved_decode_gemv
    with pytest.raises(ValueError, match="decode_gemv"):
        make_config(decode_gemv="yes")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--decode-gemv", "on"]).decode_gemv == "on"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg, 64)
    assert not model.decode_gemv and not any(l.decode_gemv for l in model.model.layers)
    model.set_decode_gemv(True)
    assert model.decode_gemv and all(l.decode_gemv for l in model.model.layers)


def test_runner_sets_decode_gemv_from_its_config(tmp_path):
    """The runner flags the model (before any graph capture) as its config resolves."""
    import json

    from kvfit.config import make_config
    from kvfit.engine.runner import ModelRunner
    from modelhelpers import TINY

    cfg = dict(TINY["llama"], architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for seqs, want in ((1, True), (4, False)):
        runner = ModelRunner(make_config(model=str(tmp_path / "config.json"),
                                         load_format="dummy", device="cpu", num_tokens=256,
                                         max_model_len=128, max_num_seqs=seqs,
                                         max_num_batched_tokens=128))
        assert runner.model.decode_gemv is want
        assert all(layer.decode_gemv is want for layer in runner.model.model.layers)
