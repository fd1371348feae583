"""The Triton MLA kernels (kernels/mla.py) on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``), tiny shapes, against the float64 reference: decode with and without
splits, prefill chunks over a cached prefix mixed with decode tokens, bf16 and fp8 latents, a
rank and rope that are not powers of two, and the quantizing latent store bit-exact with
``kvcache.quant.quantize``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if torch.cuda.is_available():  # the GPU tests cover these kernels there
    pytest.skip("interpreter tests run on CPU-only hosts", allow_module_level=True)
# before Triton is imported; only on hosts without CUDA (no kernel runs compiled there)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvfit.kernels.mla import (decode_config, mla_decode, mla_prefill, order_mla_blocks,  # noqa: E402
                               prefill_config, store_latent)
from kvfit.kvcache.dtypes import kv_format  # noqa: E402
from kvfit.kvcache.quant import quantize  # noqa: E402

from mla_kernel_ref import mla_reference, random_latent_batch  # noqa: E402

TOL = {"float16": 5e-3, "fp8_e4m3": 2e-2, "fp8_e5m2": 2e-2}
# 16-bit latents run as float16 here: the interpreter's tl.dot has no bfloat16 (numpy has none);
# the kernel code is the same for both and the GPU tests cover bfloat16
Q_DTYPE = {"float16": torch.float16, "fp8_e4m3": torch.bfloat16, "fp8_e5m2": torch.bfloat16}


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt,splits,page", [("float16", 1, 16), ("float16", 3, 8),
                                             ("fp8_e4m3", 2, 16), ("fp8_e5m2", 1, 32)])
def test_mla_decode_matches_reference(fmt, splits, page):
    heads, rank, rope = 4, 32, 16
    kv_lens = [37, 5, 70]
    q_lens = [1] * len(kv_lens)
    q, cache, table, cu, kv, stored = random_latent_batch(q_lens, kv_lens, heads, rank, rope,
                                                          page, fmt, "cpu", seed=splits,
                                                          q_dtype=Q_DTYPE[fmt], scale=0.5)
    sm = 0.3
    cfg = decode_config(len(kv_lens), heads, rank, max(kv_lens), cache.dtype, q.dtype,
                        block_n=16, num_splits=splits)
    out = torch.full((len(kv_lens), heads, rank), float("nan"), dtype=q.dtype)
    mla_decode(q, cache, table, cu, kv, out, rank, sm, cfg, scale=0.5)
    ref = mla_reference(q, stored, q_lens, kv_lens, rank, sm)
    assert _rel(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", ["float16", "fp8_e4m3"])
def test_mla_prefill_matches_reference(fmt):
    heads, rank, rope, page = 3, 32, 8, 8
    q_lens, kv_lens = [9, 1, 5], [9, 20, 14]  # a fresh prompt, a decode token, an extension
    q, cache, table, cu, kv, stored = random_latent_batch(q_lens, kv_lens, heads, rank, rope,
                                                          page, fmt, "cpu", seed=7,
                                                          q_dtype=Q_DTYPE[fmt])
    cfg = prefill_config(heads, cache.dtype, q.dtype)
    cfg = type(cfg)(16, 16, 4, 1)
    blocks = order_mla_blocks(q_lens, kv_lens, heads, cfg.block_m, "cpu")
    out = torch.full((sum(q_lens), heads, rank), float("nan"), dtype=q.dtype)
    mla_prefill(q, cache, table, cu, kv, blocks, out, rank, 0.2, cfg)
    ref = mla_reference(q, stored, q_lens, kv_lens, rank, 0.2)
    assert _rel(out, ref) < TOL[fmt]


def test_mla_odd_rank_float32_exact():
    heads, rank, rope, page = 2, 24, 6, 4
    q_lens, kv_lens = [3, 1], [7, 11]
    q, cache, table, cu, kv, stored = random_latent_batch(q_lens, kv_lens, heads, rank, rope,
                                                          page, "float32", "cpu",
                                                          q_dtype=torch.float32, seed=2)
    cfg = prefill_config(heads, cache.dtype, q.dtype)
    blocks = order_mla_blocks(q_lens, kv_lens, heads, cfg.block_m, "cpu")
    out = torch.full((4, heads, rank), float("nan"))
    mla_prefill(q, cache, table, cu, kv, blocks, out, rank, 0.25, cfg)
    assert _rel(out, mla_reference(q, stored, q_lens, kv_lens, rank, 0.25)) < 1e-5


@pytest.mark.parametrize("fmt,scale", [("float16", 0.5), ("float32", 1.0)])
def test_store_latent_bit_exact(fmt, scale):
    """16/32-bit pools here; the interpreter's float32 -> fp8 cast rounds wrongly when the
    mantissa carries into the exponent (30.375 -> 16 in e5m2), so the fp8 stores are checked
    bit-exact on the GPU (tests/gpu/test_mla_triton.py)."""
    f = kv_format(fmt)
    g = torch.Generator().manual_seed(1)
    slab, page = 40, 4
    kv = (torch.randn(6, slab, generator=g) * 100).to(torch.float16)
    cache = torch.full((5, page, slab), float("nan")).to(f.torch_dtype)
    slots = torch.tensor([3, 17, -1, 0, 9, 10])
    store_latent(kv, cache, slots, f, scale)
    want = quantize(kv, f, scale)
    flat = cache.view(-1, slab)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s].view(torch.uint8) if f.itemsize == 1 else flat[s],
                               want[t].view(torch.uint8) if f.itemsize == 1 else want[t])
    assert torch.isnan(flat[1].float()).all()  # the skipped token wrote nothing


def test_tiny_deepseek_through_triton_backend_matches_hf(caplog):
    """The triton backend's MLA wiring (store, prefill chunks, decode steps: TritonMLA) on the
    tiny DeepSeek-V2 in float32 under the interpreter: HF's logits; the decode kernel named once
    in the log."""
    import logging

    import test_mla as tm
    from modelhelpers import chunked_schedule, random_sequences

    cfg, hf, ours = tm._hf_and_ours("lite")
    seqs = random_sequences(cfg, [7, 4], 4)
    with caplog.at_level(logging.INFO, logger="kvfit"):
        got = tm.drive_mla(ours, cfg, seqs, chunked_schedule([7, 4], 4, 4),
                           backend_name="triton")[0]
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MLA decode:")]
    assert told == ["MLA decode: the Triton row kernel over torch.float32 latents"]
    for seq, g in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        assert ((g - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("fmt,splits,page,block_n,heads", [
    ("float16", 1, 16, 16, 4), ("float16", 3, 8, 32, 16), ("fp8_e4m3", 2, 16, 32, 5),
    ("fp8_e5m2", 1, 32, 16, 16), ("float16", 2, 32, 64, 20), ("fp8_e4m3:q", 2, 16, 32, 5),
    ("fp8_e4m3:q", 1, 32, 64, 16), ("float16:p", 3, 8, 16, 4), ("fp8_e4m3:qp", 2, 16, 32, 16),
    ("fp8_e5m2:p", 1, 16, 64, 5), ("float16:h", 1, 8, 16, 4), ("fp8_e4m3:qh", 3, 16, 32, 16),
    ("float16:h", 2, 32, 16, 6)])
def test_mla_decode_swapped_matches_reference(fmt, splits, page, block_n, heads):
    """The swapped decode kernel (heads as the MMAs' N, mla_decode_kernels): heads that do not
    fill the head block, tiles smaller and larger than a page, a request shorter than a tile."""
    fmt, kind = (fmt + ":").split(":")[:2]  # q: logits by fp8 x fp8 MMAs; p: register prefetch
    rank, rope = 32, 16
    kv_lens = [37, 5, 70]
    q_lens = [1] * len(kv_lens)
    q, cache, table, cu, kv, stored = random_latent_batch(q_lens, kv_lens, heads, rank, rope,
                                                          page, fmt, "cpu", seed=splits + heads,
                                                          q_dtype=Q_DTYPE[fmt], scale=0.5)
    cfg = decode_config(len(kv_lens), heads, rank, max(kv_lens), cache.dtype, q.dtype,
                        block_n=block_n, num_splits=splits)
    # h: page ids hoisted, chunks of 2 tiles (several chunks per split, chunk starts that are
    # not page-aligned when the tile is smaller than a page)
    cfg = dataclasses.replace(cfg, swap=True, qfp8="q" in kind, prefetch="p" in kind,
                              hoist=2 if "h" in kind else 0)
    out = torch.full((len(kv_lens), heads, rank), float("nan"), dtype=q.dtype)
    mla_decode(q, cache, table, cu, kv, out, rank, 0.3, cfg, scale=0.5)
    ref = mla_reference(q, stored, q_lens, kv_lens, rank, 0.3)
    assert _rel(out, ref) < TOL[fmt]


@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_compile_failure_falls_back_to_triton_kernels(monkeypatch, caplog, splits):
    """A Triton that cannot build the Gluon kernel (its names moved between releases): the
    first launch logs one warning naming the Triton version, runs the Triton kernels at the
    config's split count (the caller's split scratch stays valid), writes the same output as
    a Triton config; ``usable`` turns false so later configs never pick Gluon; the next call
    does not try to compile again."""
    import dataclasses
    import logging

    from kvfit.kernels import mla_decode_gluon, mla_gluon

    heads, rank, rope, page = 4, 32, 16, 16
    kv_lens = [37, 5, 70]
    q, cache, table, cu, kv, stored = random_latent_batch([1] * 3, kv_lens, heads, rank, rope,
                                                          page, "float16", "cpu", seed=11,
                                                          q_dtype=torch.float16)
    # the Triton config the fallback derives: same split count, no Gluon
    tri = decode_config(3, heads, rank, 0, cache.dtype, q.dtype, num_splits=splits, gluon=False,
                        rope=rope)
    ref_out = torch.full((3, heads, rank), float("nan"), dtype=q.dtype)
    mla_decode(q, cache, table, cu, kv, ref_out, rank, 0.3, tri)
    builds = []

    def broken_build():
        builds.append(1)
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute "
                             "'thread_barrier'")

    monkeypatch.setattr(mla_gluon, "_failures", [])
    monkeypatch.setattr(mla_gluon, "gluon_fits", lambda *a: True)  # this tiny slab, for the test
    monkeypatch.setattr(mla_decode_gluon, "build", broken_build)
    cfg = dataclasses.replace(tri, gluon=True)
    scratch = (torch.full((3 * heads * splits, rank), float("nan")),
               torch.full((3 * heads * splits,), float("nan")))
    with caplog.at_level(logging.WARNING, logger="kvfit"):
        for _ in range(2):
            out = torch.full((3, heads, rank), float("nan"), dtype=q.dtype)
            mla_decode(q, cache, table, cu, kv, out, rank, 0.3, cfg, scratch=scratch)
            assert torch.equal(out, ref_out)
    assert len(builds) == 1  # tried once
    warned = [r for r in caplog.records if "Gluon MLA decode kernel does not compile" in r.message]
    assert len(warned) == 1 and "thread_barrier" in warned[0].getMessage()
    assert not mla_gluon.usable(0)
    assert _rel(ref_out, mla_reference(q, stored, [1] * 3, kv_lens, rank, 0.3)) < TOL["float16"]
