"""The triton backend over the hybrid sliding-window pool on the CPU, under Triton's interpreter,
against the torch reference backend: windows shorter and longer than the prompts, chunks that
cross the window edge, decode past freed sliding pages, token-major and token-minor V pages,
float32/float16 pools (store kernel included) and fp8 pools (read path: the interpreter's fp8
cast rounds differently from torch's, so K/V are stored by the pool's torch store)."""

from __future__ import annotations

import pytest

import torch

import triton_interp

pytest.importorskip("triton")
if not triton_interp.enable():
    pytest.skip("a CUDA machine runs the compiled kernels (tests/gpu/test_swa_triton_cuda.py)",
                allow_module_level=True)

from swa_cases import run_case, window_schedule  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("kv_dtype,compute,page,window,v_layout", [
    ("float32", torch.float32, 4, 7, "HND"),
    ("float16", torch.float16, 4, 20, "HND"),
    ("float16", torch.float16, 8, 7, "HDN"),
    ("int8", torch.float16, 4, 7, "HND"),
    ("int8", torch.float16, 8, 7, "HDN"),
])
def test_triton_swa_matches_torch_interpreted(kv_dtype, compute, page, window, v_layout):
    sched = window_schedule([13, 9], 5, 10)  # window 7: the prompts cross it; 20: they do not
    errs = run_case(CPU, kv_dtype, compute, page, window, sched, v_layout=v_layout)
    tol = 1e-5 if compute == torch.float32 else 4e-3
    assert max(errs) < tol, errs


@pytest.mark.parametrize("kv_dtype,page,v_layout", [("fp8_e4m3", 8, "HDN"),
                                                    ("fp8_e5m2", 4, "HND")])
def test_triton_swa_fp8_read_path_interpreted(kv_dtype, page, v_layout):
    sched = window_schedule([13, 9], 5, 10)
    errs = run_case(CPU, kv_dtype, torch.float16, page, 7, sched, v_layout=v_layout,
                    store_with_pool=True)
    assert max(errs) < 4e-3, errs


@pytest.mark.parametrize("use_dot,dtype,v_t", [(False, torch.float32, False),
                                               (True, torch.float16, False),
                                               (True, torch.float16, True)])
@pytest.mark.parametrize("splits,min_split", [(3, 0), (8, 16)])
@pytest.mark.parametrize("fused", [False, True])
def test_split_decode_shares_only_the_window_interpreted(use_dot, dtype, v_t, splits, min_split,
                                                         fused):
    """Split-K decode with a window: the splits cover only the window's tiles, pages behind the
    window are never read (they hold NaN here), and the merged result is the reference's. With
    a floor on the tokens per split (``min_split_tokens``, as a CUDA graph captured for long
    contexts runs short ones), the trailing splits are empty, write nothing, and the merge
    skips them (their scratch rows hold poison). ``fused``: the last live split merges in the
    split kernel (tensor-core path) and leaves its counts zero for the next call."""
    from kvfit.attention.torch_attend import attend
    from kvfit.kernels.decode import DecodeConfig, paged_decode

    g = torch.Generator().manual_seed(1)
    page, hkv, hq, d, window = 4, 1, 2, 32, 37
    kv_lens = [100, 23, 64]
    n_pages = [-(-n // page) for n in kv_lens]
    perm = torch.randperm(sum(n_pages) + 1, generator=g)[: sum(n_pages)].tolist()
    tables, at = [], 0
    for n in n_pages:
        tables.append(perm[at:at + n])
        at += n
    width = max(n_pages)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.randn(sum(n_pages) + 1, hkv, page, d, generator=g).to(dtype)
    vc = torch.randn(sum(n_pages) + 1, hkv, page, d, generator=g).to(dtype)
    for t, n in zip(tables, kv_lens):  # behind the window: poison (a read would show as NaN)
        for p in t[: max(0, n - window) // page]:
            kc[p] = float("nan")
            vc[p] = float("nan")
    q = torch.randn(len(kv_lens), hq, d, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    cfg = DecodeConfig(num_splits=splits, block_n=8, use_dot=use_dot, num_warps=4,
                       num_stages=1, v_t=v_t, min_split_tokens=min_split, fused_merge=fused)
    vcache = vc.transpose(2, 3).contiguous() if v_t else vc
    # split scratch poisoned: an empty split writes nothing, so a merge that read one would
    # take a huge log-sum-exp and NaN partials
    rows = len(kv_lens) * hq * splits
    counts = torch.zeros(len(kv_lens) * hkv, dtype=torch.int32)
    scratch = (torch.full((rows, d), float("nan")), torch.full((rows,), 1e4), counts)
    paged_decode(q, kc, vcache, bt, torch.tensor(kv_lens, dtype=torch.int32), out, d ** -0.5,
                 cfg, window=window, scratch=scratch)
    assert not counts.any()  # every (request, KV head) count back to zero
    for i, (t, n) in enumerate(zip(tables, kv_lens)):
        k = kc[t].transpose(1, 2).reshape(-1, hkv, d)[:n]  # [n, Hkv, D]
        v = vc[t].transpose(1, 2).reshape(-1, hkv, d)[:n]
        first = max(0, n - window)
        ref = attend(q[i:i + 1].float(), k[first:].float(), v[first:].float(), d ** -0.5,
                     window=window, key_offset=first)
        assert torch.isfinite(out[i]).all()
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert (out[i].float() - ref[0]).abs().max().item() < tol


def test_triton_backend_needs_hybrid_metadata():
    """Plain metadata (no sliding tables) over a windowed pool is refused, never a silent read of
    the full layers' page ids in the sliding page space."""
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    layers = [KVLayerSpec("sliding", 1, 64, 8), KVLayerSpec("full", 1, 64)]
    pool = HybridSWAKVCache(layers, 4, 4, kv_format("float16"), CPU, num_swa_pages=4)
    be = TritonBackend(pool, torch.float16, 0.125)
    be.prepare(build_metadata([3], [3], [[0]], 4, CPU))
    x = torch.randn(3, 1, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="build_step_metadata"):
        be.forward(x, x, x, 0)
    with pytest.raises(RuntimeError, match="build_step_metadata"):
        be.kv_store_target(0)
