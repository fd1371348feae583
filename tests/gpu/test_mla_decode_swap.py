"""The swapped MLA decode kernel (heads as the MMAs' N, kernels/mla_decode_kernels.py) on the
GPU against the float64 reference: every latent format, pages of 16 and 32, 64- and 32-token
tiles (and tiles smaller than a page), register prefetch, page ids hoisted out of the tile
loop, V2-Lite's 16 heads and V2's 128 (four programs per request), split and single-split
decode, e4m3 logits by fp8 MMAs (``qfp8``), requests shorter than a tile, NaN-poisoned output
and unused pages; and its CUDA-graph replay equal to eager."""

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
TOL = {"bfloat16": 1.5e-2, "fp8_e4m3": 2e-2, "fp8_e5m2": 2e-2}


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _cfg(batch, heads, max_len, cache, q, variant, splits=None):
    from kvfit.kernels.mla import decode_config

    kind, bn, w, st = variant.split(":")
    return decode_config(batch, heads, 512, max_len, cache.dtype, q.dtype, block_n=int(bn),
                         num_warps=int(w), num_stages=int(st), num_splits=splits, swap=True,
                         qfp8="q" in kind, prefetch="p" in kind,
                         hoist=max(1, 1024 // int(bn)) if "h" in kind else 0)


@pytest.mark.parametrize("fmt,page,heads,variant,splits", [
    ("bfloat16", 16, 16, "s:64:8:2", None), ("bfloat16", 32, 128, "s:32:4:3", 1),
    ("bfloat16", 16, 16, "sh:32:8:4", None), ("bfloat16", 32, 16, "sh:16:4:4", None),
    ("fp8_e4m3", 32, 16, "sq:64:8:2", None), ("fp8_e4m3", 32, 16, "sh:32:8:4", 1),
    ("fp8_e5m2", 16, 128, "sh:16:4:4", None), ("fp8_e4m3", 32, 128, "sp:32:8:1", None)])
def test_mla_swapped_decode_kernel(fmt, page, heads, variant, splits):
    from kvfit.kernels.mla import mla_decode

    kv_lens = [3000, 17, 513, 1]
    q, cache, table, cu, kv, stored = random_latent_batch([1] * 4, kv_lens, heads, 512, 64,
                                                          page, fmt, DEV, seed=heads + page,
                                                          scale=0.5)
    sm = 192 ** -0.5
    cfg = _cfg(4, heads, max(kv_lens), cache, q, variant, splits)
    assert cfg.swap and cfg.qfp8 == ("q" in variant) and cfg.prefetch == ("p" in variant)
    assert (cfg.hoist > 0) == ("h" in variant)
    assert (cfg.num_splits > 1) == (splits is None)
    out = torch.full((4, heads, 512), float("nan"), dtype=q.dtype, device=DEV)
    mla_decode(q, cache, table, cu, kv, out, 512, sm, cfg, scale=0.5)
    assert _rel(out, mla_reference(q, stored, [1] * 4, kv_lens, 512, sm)) < TOL[fmt]


@pytest.mark.parametrize("fmt,variant", [("bfloat16", "sh:32:8:4"), ("fp8_e4m3", "sh:32:8:4")])
def test_mla_swapped_decode_graph_replay(fmt, variant):
    """Captured once, replayed after the cache, lengths and query change: equals eager."""
    err = decode_graph_replay_error(
        lambda b, h, n, cache, q: _cfg(b, h, n, cache, q, variant), fmt, DEV)
    assert err < TOL[fmt]
