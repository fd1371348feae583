"""The Gluon 8-bit decode (kernels/decode_8bit_gluon.py) on a Hopper GPU against the float32
reference over the dequantized pages: fp8_e4m3 / fp8_e5m2 (with per-tensor scales) and int8
(per-token scales; int8 keys on s8 MMAs), head_dim 64/128/256, pages of 16/32/64, 1 to 5
splits, lengths ending mid-page, on a tile boundary and inside the first page; every
unwritten page byte poisoned (NaN fp8 codes, NaN int8 scales) and the output poisoned. Also
through the triton backend with the kernel on (eager and a CUDA-graph replay)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.kernels import decode_8bit_gluon
from kvfit.kernels.decode import choose_config, paged_decode

from int8helpers import fill_int8_prefix, make_int8_pool, reference_attention
from kvhelpers import BOUND, DEV, fill_prefix, make_pool, poison_, random_tables, reference, rel_err

pytestmark = pytest.mark.gpu

LENS = [[1, 17, 300, 1000, 64, 5], [4097], [33] * 40]
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def _needs_hopper():
    if not decode_8bit_gluon.available():
        pytest.skip("the Gluon 8-bit decode needs a Hopper GPU and Gluon's Hopper module")


def _problem(kv_dtype: str, hq: int, hkv: int, d: int, page: int, lens, seed: int):
    """(q, pool, meta, float32 reference, scale kwargs of paged_decode)."""
    torch.manual_seed(seed)
    b = len(lens)
    num_pages = sum(-(-n // page) for n in lens) + 3
    tables = random_tables(lens, page, num_pages, seed=seed)
    if kv_dtype == "int8":
        pool = make_int8_pool(page, hkv, d, num_pages, DEV, "HDN")
        fill_int8_prefix(pool, [0] * b, lens, tables, scale=2.0)
        kw = dict(k_scale_cache=pool.k_scale_caches[0], v_scale_cache=pool.v_scale_caches[0])
    else:
        pool = make_pool(kv_dtype, page, hkv, d, num_pages, k_scale=0.7, v_scale=1.3,
                         v_layout="HDN")
        fill_prefix(pool, [0] * b, lens, tables, torch.bfloat16, scale=1.5)
        kw = dict(k_scale=0.7, v_scale=1.3)
    meta = build_metadata([1] * b, lens, tables, page, DEV)
    q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
    ref = (reference_attention(pool, q, meta, d ** -0.5) if kv_dtype == "int8"
           else reference(pool, q, meta, d ** -0.5))
    return q, pool, meta, ref, kw


def _run(q, pool, meta, cfg, kw, dtype=torch.bfloat16):
    q = q.to(dtype)
    out = poison_(torch.empty_like(q))
    paged_decode(q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.kv_lens, out,
                 q.shape[2] ** -0.5, cfg, **kw)
    return out


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
@pytest.mark.parametrize("hq,hkv,d,page", [(9, 3, 64, 16), (16, 8, 128, 32), (8, 4, 256, 32)])
def test_gluon_8bit_exchanged_maximum_changes_no_bit(monkeypatch, kv_dtype, hq, hkv, d, page):
    """The tile maximum through shared memory with one barrier (``EXCHANGE_MAX``) is the
    maximum Gluon's reduction computes, and its barrier stands for the one before P's store:
    the same bits out, split and single, every length kind; and the reference's values."""
    _needs_hopper()
    for outs, ref, case in _runs_under(monkeypatch, "EXCHANGE_MAX", (False, True), kv_dtype,
                                       hq, hkv, d, page, 21):
        assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1]), case
        assert rel_err(outs[1], ref) < BOUND[torch.bfloat16]


def _runs_under(monkeypatch, attr, values, kv_dtype, hq, hkv, d, page, seed):
    """(outputs with ``decode_8bit_gluon.<attr>`` set to each of ``values``, the reference,
    the case) for every length kind of LENS and the split counts {the default's, 1, 3}."""
    for i, lens in enumerate(LENS):
        q, pool, meta, ref, kw = _problem(kv_dtype, hq, hkv, d, page, lens, seed + i)
        cfg = choose_config(len(lens), hkv, hq // hkv, d, max(lens), DTYPES[kv_dtype],
                            q.dtype, v_t=True, page_size=page, gluon=True)
        for splits in sorted({cfg.num_splits, 1, 3}):
            c = dataclasses.replace(cfg, num_splits=splits)
            outs = []
            for v in values:
                monkeypatch.setattr(decode_8bit_gluon, attr, v)
                outs.append(_run(q, pool, meta, c, kw))
            yield outs, ref, (c, lens)


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
@pytest.mark.parametrize("hq,hkv,d,page", [(9, 3, 64, 16), (16, 8, 128, 32), (32, 8, 128, 16),
                                           (32, 2, 128, 64), (8, 4, 256, 32)])
@pytest.mark.parametrize("lens_idx", [0, 1, 2])
def test_gluon_8bit_decode_matches_reference(kv_dtype, hq, hkv, d, page, lens_idx):
    _needs_hopper()
    lens = LENS[lens_idx]
    q, pool, meta, ref, kw = _problem(kv_dtype, hq, hkv, d, page, lens, 5 + lens_idx)
    cfg = choose_config(len(lens), hkv, hq // hkv, d, max(lens), DTYPES[kv_dtype], q.dtype,
                        v_t=True, page_size=page, gluon=True)
    assert cfg.gluon
    for splits in sorted({cfg.num_splits, 1, 2, 3, 5}):
        c = dataclasses.replace(cfg, num_splits=splits)
        err = rel_err(_run(q, pool, meta, c, kw), ref)
        assert err < BOUND[torch.bfloat16], (c, err)
    # float16 queries and output too
    err = rel_err(_run(q, pool, meta, cfg, kw, torch.float16), ref)
    assert err < BOUND[torch.float16] * 2, err
    assert not decode_8bit_gluon._failures


def test_gluon_8bit_decode_equals_the_triton_kernel_closely():
    """The same pages through the Gluon and the Triton kernels agree to bf16 rounding (both
    float16 products of the same float16 operands, summed in other orders)."""
    _needs_hopper()
    lens = [2048, 1500, 31, 700]
    for kv_dtype in DTYPES:
        q, pool, meta, ref, kw = _problem(kv_dtype, 16, 8, 128, 32, lens, 21)
        tri = choose_config(len(lens), 8, 2, 128, 2048, DTYPES[kv_dtype], q.dtype, v_t=True,
                            page_size=32)
        glu = choose_config(len(lens), 8, 2, 128, 2048, DTYPES[kv_dtype], q.dtype, v_t=True,
                            page_size=32, gluon=True)
        a, b = _run(q, pool, meta, tri, kw), _run(q, pool, meta, glu, kw)
        assert rel_err(b, a.float()) < 4e-3, kv_dtype
        assert rel_err(a, ref) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_backend_decode_through_gluon_eager_and_graph(kv_dtype, monkeypatch):
    """The triton backend picks the kernel when ``DEFAULT_ON`` lists the pool's format and head
    size for this GPU; its decode (``forward`` over the stored pages) eagerly, and replayed
    from a CUDA graph captured after ``init_cuda_graph`` / ``prepare_cuda_graph`` (static
    split scratch, split count fixed by the batch size) with new queries, matches the
    reference."""
    _needs_hopper()
    from kvfit.attention.triton_backend import TritonBackend

    monkeypatch.setattr(decode_8bit_gluon, "DEFAULT_ON",
                        {torch.cuda.get_device_name(): frozenset({("fp8", 128), ("int8", 128)})})
    hq, hkv, d, page = 16, 8, 128, 32
    lens = [300, 65, 1024, 7]
    q, pool, meta, ref, _ = _problem(kv_dtype, hq, hkv, d, page, lens, 31)
    be = TritonBackend(pool, torch.bfloat16, d ** -0.5)
    be.num_q_heads = hq
    assert be._gluon_decode()
    be.prepare(meta)
    assert be._decode_cfg.gluon
    out = be.forward(q, None, None, 0, kv_stored=True)
    assert rel_err(out, ref) < BOUND[torch.bfloat16]
    be.init_cuda_graph(len(lens), meta.block_table.shape[1])
    be.prepare_cuda_graph(meta)
    assert be._decode_cfg.gluon and be._scratch is not None
    g_q = q.clone()
    be.forward(g_q, None, None, 0, kv_stored=True)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = be.forward(g_q, None, None, 0, kv_stored=True)
    for seed in range(3):
        torch.manual_seed(100 + seed)
        q2 = torch.randn_like(q)
        g_q.copy_(q2)
        poison_(g_out)
        graph.replay()
        want = (reference_attention(pool, q2, meta, d ** -0.5) if kv_dtype == "int8"
                else reference(pool, q2, meta, d ** -0.5))
        assert rel_err(g_out, want) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
@pytest.mark.parametrize("hq,hkv,d,page", [(9, 3, 64, 16), (32, 2, 128, 64), (8, 4, 256, 32)])
def test_gluon_8bit_l2_prefetch_changes_no_bit(monkeypatch, kv_dtype, hq, hkv, d, page):
    """``L2_AHEAD``: asking L2 for tiles 2 or 3 ahead changes what the caches hold, not a
    value: the same bits out as without it, split and single, every length kind (splits
    shorter than the distance included)."""
    _needs_hopper()
    for outs, ref, case in _runs_under(monkeypatch, "L2_AHEAD", ({d: 0}, {d: 2}, {d: 3}),
                                       kv_dtype, hq, hkv, d, page, 31):
        assert not outs[0].isnan().any(), case
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), case
        assert rel_err(outs[0], ref) < BOUND[torch.bfloat16]
