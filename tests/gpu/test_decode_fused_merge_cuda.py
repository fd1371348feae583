"""The split decode's fused merge (``DecodeConfig.fused_merge``: the last live split of each
(request, KV head) merges the partials in the split kernel) on the GPU, where programs really
run concurrently: against the same launch with the separate merge kernel over many calls with
fresh queries (a merge that read a partial before its split had written it would take the
previous call's values), eager and replayed from a CUDA graph, with empty splits (a graph's
split count fixed for long contexts running short ones); the counts are zero after every call;
and against the float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvhelpers import BOUND, DEV, fill_prefix, make_pool, poison_, random_tables, reference, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype,d,heads,page_size,v_layout,kv_lens,splits", [
    ("fp8_e4m3", 128, (16, 8), 32, "HDN", [1024], 64),  # batch 1: 16 live splits of 64
    ("bfloat16", 128, (16, 8), 16, "HND", [37, 900, 1500, 5, 260, 2048, 64, 700], 8),
    ("fp8_e4m3", 64, (9, 3), 16, "HDN", [300, 4000, 17], 32),
])
def test_fused_merge_matches_the_merge_kernel(kv_dtype, d, heads, page_size, v_layout, kv_lens,
                                              splits):
    from kvfit.kernels.decode import choose_config, fuses_merge, paged_decode, split_scratch

    torch.manual_seed(3)
    hq, hkv = heads
    b = len(kv_lens)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    scales = (0.5, 1.7) if kv_dtype.startswith("fp8") else (1.0, 1.0)
    pool = make_pool(kv_dtype, page_size, hkv, d, num_pages, *scales, v_layout=v_layout)
    tables = random_tables(kv_lens, page_size, num_pages, seed=2)
    cdt = torch.bfloat16
    fill_prefix(pool, [0] * b, kv_lens, tables, cdt)
    meta = build_metadata([1] * b, kv_lens, tables, page_size, DEV)
    base = choose_config(b, hkv, hq // hkv, d, max(kv_lens), pool.dtype, cdt,
                         v_t=v_layout == "HDN")
    fused = dataclasses.replace(base, num_splits=splits, fused_merge=True, heads=1, pack=1)
    plain = dataclasses.replace(fused, fused_merge=False)
    assert fuses_merge(fused) and not fuses_merge(plain)
    scratch = split_scratch(b, hq, hkv, d, fused, DEV)
    kc, vc = pool.k_caches[0], pool.v_caches[0]

    def run(cfg, q, out, scr):
        paged_decode(q, kc, vc, meta.block_table, meta.kv_lens, out, d ** -0.5, cfg, *scales,
                     scratch=scr)

    q0 = torch.randn(b, hq, d, device=DEV, dtype=cdt)
    out0 = poison_(torch.empty_like(q0))
    run(fused, q0, out0, scratch)
    assert rel_err(out0, reference(pool, q0, meta, d ** -0.5)) < BOUND[cdt]
    # a CUDA graph of the fused launch, replayed with fresh queries
    static_q, static_out = q0.clone(), torch.empty_like(q0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(fused, static_q, static_out, scratch)
    for i in range(30):
        q = torch.randn(b, hq, d, device=DEV, dtype=cdt)
        want = poison_(torch.empty_like(q))
        run(plain, q, want, None)
        got = poison_(torch.empty_like(q))
        if i % 2:
            run(fused, q, got, scratch)
        else:
            static_q.copy_(q)
            static_out.copy_(poison_(torch.empty_like(q)))
            graph.replay()
            got = static_out
        torch.cuda.synchronize()
        assert not scratch[2].any(), "the merge counts were not reset"
        assert torch.isfinite(got).all()
        # the same sums in the same order; a bf16 rounding apart at most
        bad = (got.float() - want.float()).abs() > 2 ** -7 * want.float().abs() + 1e-6
        assert not bad.any(), (i, (got.float() - want.float()).abs().max().item())
