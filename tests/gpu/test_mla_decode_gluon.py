"""The Gluon MLA decode kernel (kernels/mla_decode_gluon.py, Hopper) on the GPU against the
float64 reference: every latent format (bf16, fp16, e4m3, e5m2; e4m3 also with the logits by
fp8 MMAs, ``qfp8``, and the pipelined e4m3 kernel, ``pipe``), pages of 16 and 32, V2-Lite's
16 heads and V2's 128 (eight programs per request), single-split and split decode (the merge
kernel), 2 and 3 stages, requests shorter than a tile and of one token, NaN in unused pages
and unused slots, NaN-poisoned output; and its CUDA-graph replay equal to eager after the
cache, lengths and query change."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mla_kernel_ref import (decode_graph_replay_error, mla_reference,  # noqa: E402
                            random_latent_batch)

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {"bfloat16": 1.5e-2, "float16": 1.5e-2, "fp8_e4m3": 2e-2, "fp8_e5m2": 2e-2}


def _skip_unless_hopper():
    from kvfit.kernels.mla_gluon import gluon_available

    if not torch.cuda.is_available() or not gluon_available(torch.cuda.current_device()):
        pytest.skip("the Gluon MLA decode needs a Hopper GPU (sm_90) and Triton's Gluon")


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt,page,heads,stages,splits,qfp8,pipe", [
    ("bfloat16", 16, 16, 2, None, False, False), ("bfloat16", 32, 128, 2, 1, False, False),
    ("float16", 16, 16, 2, None, False, False), ("fp8_e4m3", 32, 16, 3, None, False, False),
    ("fp8_e4m3", 16, 16, 2, 1, False, False), ("fp8_e4m3", 32, 128, 3, None, False, False),
    ("fp8_e5m2", 16, 16, 3, None, False, False), ("fp8_e5m2", 32, 16, 3, 1, False, False),
    ("fp8_e4m3", 32, 16, 3, None, True, False), ("fp8_e4m3", 16, 128, 3, 1, True, False),
    ("fp8_e4m3", 32, 16, 2, 1, True, False), ("fp8_e4m3", 32, 16, 2, None, True, True),
    ("fp8_e4m3", 16, 128, 2, 1, True, True), ("fp8_e4m3", 16, 16, 2, 1, True, True)])
def test_mla_gluon_decode_kernel(fmt, page, heads, stages, splits, qfp8, pipe):
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config

    def make(b, cache, q, kv_lens):
        cfg = decode_config(b, heads, 512, max(kv_lens), cache.dtype, q.dtype, gluon=True,
                            num_stages=stages, num_splits=splits, qfp8=qfp8, pipe=pipe)
        assert cfg.gluon and cfg.num_stages == stages and cfg.qfp8 == qfp8 and cfg.pipe == pipe
        assert not cfg.regs and (cfg.num_splits > 1) == (splits is None)
        return cfg

    _check_against_reference(make, fmt, page, heads)


@pytest.mark.parametrize("fmt,page,heads,splits", [
    ("fp8_e4m3", 32, 16, None), ("fp8_e4m3", 16, 16, 1), ("fp8_e4m3", 64, 128, None),
    ("fp8_e4m3", 16, 128, 1), ("fp8_e5m2", 16, 16, None), ("fp8_e5m2", 32, 128, 1),
    ("fp8_e5m2", 64, 16, 1)])
def test_mla_gluon_regs_decode_kernel(fmt, page, heads, splits):
    """The register-operand kernel (mla_decode_fp8_regs; the default for e5m2 latents)."""
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config

    def make(b, cache, q, kv_lens):
        cfg = decode_config(b, heads, 512, max(kv_lens), cache.dtype, q.dtype,
                            num_splits=splits, regs=True if fmt == "fp8_e4m3" else None)
        assert cfg.gluon and cfg.regs and (cfg.num_splits > 1) == (splits is None)
        return cfg

    _check_against_reference(make, fmt, page, heads)


def _check_against_reference(make, fmt, page, heads):
    """``make(b, cache, q, kv_lens)``'s config against the float64 reference and the Triton
    kernels, on requests of 3000, 17, 513, 1, 64 and 4097 tokens (NaN in unused pages and slots,
    NaN-poisoned output)."""
    from kvfit.kernels.mla import decode_config, mla_decode

    kv_lens = [3000, 17, 513, 1, 64, 4097]
    b = len(kv_lens)
    q, cache, table, cu, kv, stored = random_latent_batch([1] * b, kv_lens, heads, 512, 64,
                                                          page, fmt, DEV, seed=heads + page,
                                                          scale=0.5)
    sm = 192 ** -0.5
    cfg = make(b, cache, q, kv_lens)
    out = torch.full((b, heads, 512), float("nan"), dtype=q.dtype, device=DEV)
    mla_decode(q, cache, table, cu, kv, out, 512, sm, cfg, scale=0.5)
    ref = mla_reference(q, stored, [1] * b, kv_lens, 512, sm)
    assert not out.isnan().any()
    assert _rel(out, ref) < TOL[fmt]
    # the Triton swapped/row kernel on the same inputs: the two agree as closely
    tri = torch.full_like(out, float("nan"))
    mla_decode(q, cache, table, cu, kv, tri, 512, sm,
               decode_config(b, heads, 512, max(kv_lens), cache.dtype, q.dtype, gluon=False),
               scale=0.5)
    assert _rel(out, tri.double().cpu()) < TOL[fmt]


@pytest.mark.parametrize("fmt,qfp8,pipe,regs", [
    ("bfloat16", False, False, False), ("fp8_e4m3", False, False, False),
    ("fp8_e4m3", True, False, False), ("fp8_e4m3", True, True, False),
    ("fp8_e4m3", None, None, True), ("fp8_e4m3", None, None, None),
    ("fp8_e5m2", None, None, None)])
def test_mla_gluon_decode_graph_replay(fmt, qfp8, pipe, regs):
    """Captured once, replayed after the cache, lengths and query change: equals eager (the
    register-operand kernel asked for, and the 8-bit formats' default, which is that kernel)."""
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config

    def make(b, h, n, cache, q):
        cfg = decode_config(b, h, 512, n, cache.dtype, q.dtype, gluon=True, qfp8=qfp8,
                            pipe=pipe, regs=regs)
        assert cfg.gluon and cfg.num_splits > 1 and cfg.pipe == bool(pipe)
        assert cfg.regs == (regs is not False)
        return cfg

    assert decode_graph_replay_error(make, fmt, DEV) < TOL[fmt]


@pytest.mark.parametrize("fmt,pipe", [("fp8_e4m3", False), ("fp8_e4m3", True),
                                      ("fp8_e5m2", False)])
def test_mla_gluon_conversion_layout_changes_no_bit(fmt, pipe):
    """Converting 8 latent values a thread instead of 16 (``conv_vec``, conflict-free float16
    stores by Gluon's count) moves where each value is converted, not its value: the same
    bits out, split and single."""
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config, mla_decode

    kv_lens = [3000, 17, 513, 1]
    q, cache, table, cu, kv, _ = random_latent_batch([1] * 4, kv_lens, 16, 512, 64, 32, fmt,
                                                     DEV, seed=9, scale=0.5)
    for splits in (None, 1):
        outs = []
        for xv in (16, 8):
            cfg = decode_config(4, 16, 512, max(kv_lens), cache.dtype, q.dtype, gluon=True,
                                pipe=pipe, qfp8=None if pipe else False, num_splits=splits,
                                conv_vec=xv)
            out = torch.full((4, 16, 512), float("nan"), dtype=q.dtype, device=DEV)
            mla_decode(q, cache, table, cu, kv, out, 512, 0.07, cfg, scale=0.5)
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt,page", [("fp8_e4m3", 32), ("fp8_e5m2", 16), ("fp8_e4m3", 64)])
def test_mla_gluon_regs_l2_prefetch_changes_no_bit(fmt, page):
    """``MLAConfig.l2_ahead`` (``GLUON_REGS_L2_AHEAD``): asking L2 for tiles 2 or 3 ahead
    changes what the caches hold, not a value: the same bits out as without it, split and
    single, over requests shorter than the distance (17, 1 tokens) and longer."""
    import dataclasses

    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config, mla_decode

    kv_lens = [3000, 17, 513, 1, 4097]
    b = len(kv_lens)
    q, cache, table, cu, kv, _ = random_latent_batch([1] * b, kv_lens, 16, 512, 64, page, fmt,
                                                     DEV, seed=11, scale=0.5)
    for splits in (None, 1):
        base = decode_config(b, 16, 512, max(kv_lens), cache.dtype, q.dtype, gluon=True,
                             regs=True, num_splits=splits)
        outs = []
        for ahead in (0, 2, 3):
            out = torch.full((b, 16, 512), float("nan"), dtype=q.dtype, device=DEV)
            mla_decode(q, cache, table, cu, kv, out, 512, 0.07,
                       dataclasses.replace(base, l2_ahead=ahead), scale=0.5)
            outs.append(out)
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
