"""The Gluon MLA decode kernel (kernels/mla_decode_gluon.py, Hopper) on the GPU against the
float64 reference: every latent format (bf16, fp16, e4m3, e5m2; e4m3 also with the logits by
fp8 MMAs, ``qfp8``), pages of 16 and 32, V2-Lite's
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
from mla_kernel_ref import mla_reference, random_latent_batch  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {"bfloat16": 1.5e-2, "float16": 1.5e-2, "fp8_e4m3": 2e-2, "fp8_e5m2": 2e-2}


def _skip_unless_hopper():
    from kvfit.kernels.mla import gluon_available

    if not torch.cuda.is_available() or not gluon_available(torch.cuda.current_device()):
        pytest.skip("the Gluon MLA decode needs a Hopper GPU (sm_90) and Triton's Gluon")


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt,page,heads,stages,splits,qfp8", [
    ("bfloat16", 16, 16, 2, None, False), ("bfloat16", 32, 128, 2, 1, False),
    ("float16", 16, 16, 2, None, False), ("fp8_e4m3", 32, 16, 3, None, False),
    ("fp8_e4m3", 16, 16, 2, 1, False), ("fp8_e4m3", 32, 128, 3, None, False),
    ("fp8_e5m2", 16, 16, 3, None, False), ("fp8_e5m2", 32, 16, 3, 1, False),
    ("fp8_e4m3", 32, 16, 3, None, True), ("fp8_e4m3", 16, 128, 3, 1, True),
    ("fp8_e4m3", 32, 16, 2, 1, True)])
def test_mla_gluon_decode_kernel(fmt, page, heads, stages, splits, qfp8):
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config, mla_decode

    kv_lens = [3000, 17, 513, 1, 64, 4097]
    b = len(kv_lens)
    q, cache, table, cu, kv, stored = random_latent_batch([1] * b, kv_lens, heads, 512, 64,
                                                          page, fmt, DEV, seed=heads + page,
                                                          scale=0.5)
    sm = 192 ** -0.5
    cfg = decode_config(b, heads, 512, max(kv_lens), cache.dtype, q.dtype, gluon=True,
                        num_stages=stages, num_splits=splits, qfp8=qfp8)
    assert cfg.gluon and cfg.num_stages == stages and cfg.qfp8 == qfp8
    assert (cfg.num_splits > 1) == (splits is None)
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


@pytest.mark.parametrize("fmt,qfp8", [("bfloat16", False), ("fp8_e4m3", False),
                                      ("fp8_e4m3", True)])
def test_mla_gluon_decode_graph_replay(fmt, qfp8):
    """Captured once, replayed after the cache, lengths and query change: equals eager."""
    _skip_unless_hopper()
    from kvfit.kernels.mla import decode_config, mla_decode

    heads, page = 16, 32 if fmt != "bfloat16" else 16
    kv_lens = [900, 40, 2100]
    q, cache, table, cu, kv, _ = random_latent_batch([1] * 3, kv_lens, heads, 512, 64, page,
                                                     fmt, DEV, seed=5)
    cfg = decode_config(3, heads, 512, 2304, cache.dtype, q.dtype, gluon=True, qfp8=qfp8)
    s = cfg.num_splits
    assert cfg.gluon and s > 1
    scratch = (torch.empty((3 * heads * s, 512), dtype=torch.float32, device=DEV),
               torch.empty((3 * heads * s,), dtype=torch.float32, device=DEV))
    out = torch.full((3, heads, 512), float("nan"), dtype=q.dtype, device=DEV)
    mla_decode(q, cache, table, cu, kv, out, 512, 0.07, cfg, scratch=scratch)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, table, cu, kv, out, 512, 0.07, cfg, scratch=scratch)
    q2, cache2, table2, _, _, stored2 = random_latent_batch([1] * 3, kv_lens, heads, 512, 64,
                                                            page, fmt, DEV, seed=6)
    new_lens = torch.tensor([899, 7, 2100], dtype=torch.int32, device=DEV)
    q.copy_(q2)
    cache.copy_(cache2)
    table.copy_(table2)
    kv.copy_(new_lens)
    out.fill_(float("nan"))
    graph.replay()
    eager = torch.empty_like(out)
    mla_decode(q, cache, table, cu, kv, eager, 512, 0.07, cfg)
    assert torch.equal(out, eager)
    ref = mla_reference(q, [st[:n] for st, n in zip(stored2, new_lens.tolist())], [1] * 3,
                        new_lens.tolist(), 512, 0.07)
    assert _rel(out, ref) < TOL[fmt]
