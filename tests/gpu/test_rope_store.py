"""RoPE with the K/V store fused in (``apply_rope(kv_store=...)``) against the two launches it
replaces (``apply_rope`` then ``store_kv``): the same rotated q and k bit for bit and the same
cache bytes (quantized formats, scales that saturate, both V page layouts, q/k norm, partial
rotary, padding slots), on fresh random inputs written into NaN-poisoned pools."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvhelpers import DEV, make_pool

pytestmark = pytest.mark.gpu

# (kv dtype, page size, scales, V layout, (Hq, Hk, D, rotary dims), q/k norm)
CASES = [
    ("bfloat16", 16, (1.0, 1.0), "HND", (16, 8, 128, 128), True),
    ("bfloat16", 1, (0.37, 2.5), "HND", (9, 3, 64, 64), False),
    ("fp8_e4m3", 32, (1.0, 1.0), "HDN", (16, 8, 128, 128), True),
    ("fp8_e4m3", 16, (0.37, 2.5), "HND", (9, 3, 64, 64), True),
    ("fp8_e5m2", 32, (0.37, 2.5), "HDN", (16, 8, 128, 64), False),
    ("float16", 16, (1.0, 1.0), "HND", (8, 8, 128, 64), False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-p{c[1]}-{c[3]}-{c[4]}-{c[5]}")
def test_fused_store_equals_rope_then_store(case):
    from kvfit.attention.base import KVStoreTarget
    from kvfit.kernels.fused_rope import apply_rope
    from kvfit.kernels.store import store_kv

    kv_dtype, ps, scales, v_layout, (hq, hk, d, rot), norm = case
    dtype = torch.float16 if kv_dtype == "float16" else torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(zlib.crc32(repr(case).encode()))
    t, num_pages = 37, 64
    pool = make_pool(kv_dtype, ps, hk, d, num_pages, *scales, v_layout=v_layout)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV, dtype=dtype, generator=g) * 3
    qkv[::7] *= 200  # saturates the fp8 formats after the scales
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # strided views, as the model has
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    positions = torch.randint(0, 4000, (t,), device=DEV, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEV).float() / rot))
    freqs = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    qk_norm = None
    if norm:
        qk_norm = (torch.rand(d, device=DEV, generator=g).to(dtype) + 0.5,
                   torch.rand(d, device=DEV, generator=g).to(dtype) + 0.5, 1e-6, 0.0)
    slots = torch.randperm(num_pages * ps, device=DEV, generator=g)[:t]
    slots[::5] = -1  # padding rows store nothing

    ref_pool = make_pool(kv_dtype, ps, hk, d, num_pages, *scales, v_layout=v_layout)
    rq, rk = apply_rope(q, k, cos, sin, positions, qk_norm=qk_norm)
    store_kv(rk, v, ref_pool.k_caches[0], ref_pool.v_caches[0], slots, ref_pool.fmt, *scales,
             v_layout)

    target = KVStoreTarget(pool.k_caches[0], pool.v_caches[0], slots, pool.fmt, *scales,
                           v_layout)
    fq, fk = apply_rope(q, k, cos, sin, positions, qk_norm=qk_norm, kv_store=(v, target))
    assert torch.equal(fq, rq) and torch.equal(fk, rk)
    for a, b in ((pool.k_caches[0], ref_pool.k_caches[0]),
                 (pool.v_caches[0], ref_pool.v_caches[0])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    live = slots[slots >= 0]
    kc = pool.k_caches[0]  # [pages, Hk, P, D]: the written rows are no longer poison
    rows = kc[live // ps, :, live % ps].float()
    assert live.numel() > 0 and not rows.isnan().any()


def test_kv_store_rejects_a_mismatched_v():
    from kvfit.attention.base import KVStoreTarget
    from kvfit.kernels.fused_rope import apply_rope

    pool = make_pool("bfloat16", 16, 2, 64, 4)
    q = torch.randn(3, 4, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 64, device=DEV, dtype=torch.bfloat16)
    cos = torch.ones(16, 64, device=DEV)
    target = KVStoreTarget(pool.k_caches[0], pool.v_caches[0],
                           torch.arange(3, device=DEV), pool.fmt, 1.0, 1.0, "HND")
    with pytest.raises(ValueError, match="v must be"):
        apply_rope(q, k, cos, cos, torch.arange(3, device=DEV),
                   kv_store=(torch.randn(3, 3, 64, device=DEV, dtype=torch.bfloat16), target))
