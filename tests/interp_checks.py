"""Checks of the int8 / K-centering Triton kernels under the Triton interpreter (CPU tensors),
run by tests/test_kernels_interpret.py in a subprocess with ``TRITON_INTERPRET=1`` (the
interpreter must be chosen before any kernel is built, and must not leak into GPU tests).

Usage: TRITON_INTERPRET=1 python3 tests/interp_checks.py stores|attention|rotation
Small shapes only (the interpreter runs each program in numpy); exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from int8_reference import gather_ref, make_int8_caches, store_ref  # noqa: E402


def _fmt():
    from kvfit.kvcache.dtypes import KVFormat, kv_format

    try:
        return kv_format("int8")
    except ValueError:
        return KVFormat("int8", torch.int8, True, 127.0)


def _same(a, b, what):
    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        raise AssertionError(f"{what}: bytes differ from the torch reference")


def _tables(kv_lens, ps, num_pages, seed):
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    out, i = [], 0
    for n in kv_lens:
        m = -(-n // ps)
        out.append(pages[i:i + m])
        i += m
    return out


def check_stores():
    """Slot-mapped, page-chunk and fused RoPE stores: int8 bytes and scales of the reference,
    with K centering, saturation-size rows, an all-zero row and padding slots."""
    from kvfit.attention.base import KVStoreTarget
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.kernels.fused_rope import apply_rope
    from kvfit.kernels.store import split_store_chunks, store_kv, store_kv_chunks

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    fmt = _fmt()
    for v_layout, (h, d, ps) in (("HND", (3, 64, 16)), ("HDN", (2, 128, 32))):
        npg, t = 8, 9
        caches = make_int8_caches(npg, h, ps, d, "cpu", v_layout)
        ref = [c.clone() for c in caches]
        k = torch.randn(t, h, d, generator=g, dtype=torch.float32).to(torch.bfloat16) * 3
        v = torch.randn(t, h, d, generator=g, dtype=torch.float32).to(torch.bfloat16)
        k[2] *= 1e4
        v[3] = 0
        k[5, 0, 7] = float("inf")  # non-finite rows: the engine's quantizer's answer
        v[6, 1, 3] = float("nan")
        mu = torch.randn(h, d, generator=g) * 5
        slots = torch.randperm(npg * ps, generator=g)[:t]
        slots[4] = -1
        store_kv(k, v, caches[0], caches[1], slots, fmt, v_layout=v_layout,
                 k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu)
        store_ref(k, v, *ref, slots, v_layout, k_mean=mu)
        for a, b in zip(caches, ref):
            _same(a, b, f"store_kv {v_layout}")
        from kvfit.kvcache.quant import quantize_int8_rows

        live = slots >= 0
        kq, kscale = quantize_int8_rows(k[live].float() - mu)  # the engine's (CPU) reference
        _same(caches[0][slots[live] // ps, :, slots[live] % ps], kq, "vs quantize_int8_rows")
        _same(caches[2][slots[live] // ps, :, slots[live] % ps], kscale, "scales vs the engine")
    # page-row chunks into token-minor V == the slot store
    h, d, ps = 2, 64, 16
    q_lens, kv_lens = [21, 1, 5], [21, 40, 37]
    npg = sum(-(-n // ps) for n in kv_lens) + 1
    meta = build_metadata(q_lens, kv_lens, _tables(kv_lens, ps, npg, 1), ps, "cpu")
    k = torch.randn(sum(q_lens), h, d, generator=g) * 2
    v = torch.randn(sum(q_lens), h, d, generator=g)
    mu = torch.randn(h, d, generator=g)
    caches = make_int8_caches(npg, h, ps, d, "cpu", "HDN")
    ref = [c.clone() for c in caches]
    store_kv_chunks(k, v, caches[0], caches[1], split_store_chunks(q_lens, kv_lens, ps, "cpu"),
                    meta.cu_seqlens_q, meta.kv_lens, meta.block_table, fmt,
                    k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu)
    store_ref(k, v, *ref, meta.slot_mapping, "HDN", k_mean=mu)
    for a, b in zip(caches, ref):
        _same(a, b, "store_kv_chunks")
    # RoPE + store in one launch == RoPE, then the reference store
    hq, hk, d, rot, t, ps, npg = 4, 2, 64, 32, 7, 16, 4
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(torch.bfloat16) * 3
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    pos = torch.randint(0, 100, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.outer(torch.arange(128).float(), inv)
    emb = torch.cat((emb, emb), -1)
    slots = torch.randperm(npg * ps, generator=g)[:t]
    slots[1] = -1
    mu = torch.randn(hk, d, generator=g) * 4
    caches = make_int8_caches(npg, hk, ps, d, "cpu", "HND")
    ref = [c.clone() for c in caches]
    rq, rk = apply_rope(q, k, emb.cos(), emb.sin(), pos)
    store_ref(rk, v, *ref, slots, "HND", k_mean=mu)
    target = KVStoreTarget(caches[0], caches[1], slots, fmt, 1.0, 1.0, "HND",
                           k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu)
    fq, fk = apply_rope(q, k, emb.cos(), emb.sin(), pos, kv_store=(v, target))
    if not (torch.equal(fq, rq) and torch.equal(fk, rk)):
        raise AssertionError("apply_rope(kv_store=...) changed the rotated q/k")
    for a, b in zip(caches, ref):
        _same(a, b, "fused RoPE + int8 store")
    # a rotating target: (k - mu) @ H by butterflies in registers == torch's butterflies (q is
    # checked on the GPU only: the interpreter's float32 -> bfloat16 cast does not round to
    # nearest even)
    from kvfit.kernels.hadamard import fwht

    emb_full = torch.outer(torch.arange(128).float(), 1.0 / (10000 ** (
        torch.arange(0, d, 2).float() / d)))
    emb_full = torch.cat((emb_full, emb_full), -1)
    caches = make_int8_caches(npg, hk, ps, d, "cpu", "HND")
    ref = [c.clone() for c in caches]
    rq, rk = apply_rope(q, k, emb_full.cos(), emb_full.sin(), pos)
    store_ref(fwht(rk.float() - mu), v, *ref, slots, "HND")
    target = KVStoreTarget(caches[0], caches[1], slots, fmt, 1.0, 1.0, "HND",
                           k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu,
                           rotate=True)
    fq, fk = apply_rope(q, k, emb_full.cos(), emb_full.sin(), pos, kv_store=(v, target))
    if not torch.equal(fk, rk):
        raise AssertionError("a rotating apply_rope changed the returned k")
    if not ((fq.float() - fwht(rq)).norm() / fwht(rq).norm()) < 1e-2:
        raise AssertionError("a rotating apply_rope did not return q @ H")
    for a, b in zip(caches, ref):
        _same(a, b, "fused RoPE + rotated int8 store")


def check_attention():
    """int8 decode (tensor-core and CUDA-core paths, 1 and 3 splits) and prefill (window) vs a
    float32 reference over the dequantized pages; outputs start as NaN."""
    import dataclasses

    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.torch_attend import attend
    from kvfit.kernels.decode import choose_config, paged_decode
    from kvfit.kernels.prefill import PrefillConfig, order_prefill_blocks, paged_prefill

    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    hq, hkv, d, ps = 4, 2, 64, 16
    for v_layout, q_lens, kv_lens, window in (("HND", [1, 1, 1], [5, 70, 33], None),
                                               ("HDN", [7, 1, 20], [7, 40, 50], 13)):
        npg = sum(-(-n // ps) for n in kv_lens) + 2
        tables = _tables(kv_lens, ps, npg, 0)
        caches = make_int8_caches(npg, hkv, ps, d, "cpu", v_layout)
        full = build_metadata(kv_lens, kv_lens, tables, ps, "cpu")
        store_ref(torch.randn(sum(kv_lens), hkv, d) * 2, torch.randn(sum(kv_lens), hkv, d),
                  *caches, full.slot_mapping, v_layout)
        meta = build_metadata(q_lens, kv_lens, tables, ps, "cpu")
        q = torch.randn(sum(q_lens), hq, d).to(torch.bfloat16)
        ref = torch.empty(q.shape)
        start = 0
        for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            kk, vv = gather_ref(*caches, meta.block_table[i, :meta.num_pages_cpu[i]], kl,
                                v_layout)
            ref[start:start + ql] = attend(q[start:start + ql].float(), kk, vv, d ** -0.5,
                                           window=window)
            start += ql
        scales = dict(k_scale_cache=caches[2], v_scale_cache=caches[3])
        outs = []
        if meta.is_decode:
            for use_dot in (True, False):
                cfg = choose_config(3, hkv, hq // hkv, d, max(kv_lens), torch.int8, q.dtype,
                                    use_dot=use_dot, v_t=v_layout == "HDN")
                cvts = ((1, "bias"), (3, "asm"))
                if use_dot:  # K by int8 MMAs / biased, V biased / asm
                    cvts += ((2, "imma"), (1, "imma-bias"), (3, "kbias"), (2, "imma1"))
                for splits, cvt in cvts:
                    # the tensor-core splits also with the merge fused into the split kernel
                    for fused in ((False, True) if use_dot and splits > 1 else (False,)):
                        out = torch.full_like(q, float("nan"))
                        c = dataclasses.replace(cfg, num_splits=splits, i8_cvt=cvt)
                        if fused:
                            c = dataclasses.replace(c, fused_merge=True, heads=1, pack=1)
                        paged_decode(q, caches[0], caches[1], meta.block_table, meta.kv_lens,
                                     out, d ** -0.5, c, window=window, **scales)
                        outs.append(out)
            # several KV heads per program (2: both heads; 4: two of them masked)
            for heads, splits, cvt in ((2, 1, "imma"), (4, 3, "asm"), (2, 2, "imma1")):
                out = torch.full_like(q, float("nan"))
                c = dataclasses.replace(cfg, use_dot=True, heads=heads, num_splits=splits,
                                        i8_cvt=cvt, block_n=32)
                paged_decode(q, caches[0], caches[1], meta.block_table, meta.kv_lens, out,
                             d ** -0.5, c, window=window, **scales)
                outs.append(out)
            # packed: 2 sub-splits of the group of 2 in the 16 MMA rows
            out = torch.full_like(q, float("nan"))
            c = dataclasses.replace(cfg, use_dot=True, pack=8, block_n=128, num_splits=2,
                                    i8_cvt="bias")
            paged_decode(q, caches[0], caches[1], meta.block_table, meta.kv_lens, out,
                         d ** -0.5, c, window=window, **scales)
            outs.append(out)
        else:
            cfg = PrefillConfig(32, 32, 4, 1)
            blocks = order_prefill_blocks(q_lens, hq // hkv, cfg.block_m, "cpu", kv_lens)
            out = torch.full_like(q, float("nan"))
            paged_prefill(q, caches[0], caches[1], meta.block_table, meta.cu_seqlens_q,
                          meta.kv_lens, blocks, cfg, out, d ** -0.5, window=window,
                          v_t=v_layout == "HDN", **scales)
            outs.append(out)
        for out in outs:
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 6e-3:  # NaN fails too
                raise AssertionError(f"int8 attention ({v_layout}) relative error {err}")


def check_rotation():
    """The prefill-side rotation: the page-chunk store of (k - mu) @ H (bytes of the torch
    butterflies + reference store), the prefill kernel's in-register q @ H (against a prefill
    of q rotated in torch), and TritonBackend with a rotating KVTransform over token-minor V
    pages (prefill then decode steps) against the torch reference backend."""
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.torch_ref import TorchRefBackend
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kernels.hadamard import fwht
    from kvfit.kernels.prefill import PrefillConfig, order_prefill_blocks, paged_prefill
    from kvfit.kernels.store import split_store_chunks, store_kv_chunks
    from kvfit.kvcache.kv_transform import KVTransform
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    fmt = _fmt()
    hq, h, d, ps = 4, 2, 64, 16
    q_lens, kv_lens = [21, 1, 5], [21, 40, 37]
    npg = sum(-(-n // ps) for n in kv_lens) + 1
    meta = build_metadata(q_lens, kv_lens, _tables(kv_lens, ps, npg, 2), ps, "cpu")
    k = (torch.randn(sum(q_lens), h, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(sum(q_lens), h, d, generator=g).to(torch.bfloat16)
    mu = torch.randn(h, d, generator=g) * 3
    caches = make_int8_caches(npg, h, ps, d, "cpu", "HDN")
    ref = [c.clone() for c in caches]
    store_kv_chunks(k, v, caches[0], caches[1], split_store_chunks(q_lens, kv_lens, ps, "cpu"),
                    meta.cu_seqlens_q, meta.kv_lens, meta.block_table, fmt,
                    k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu, rotate=True)
    store_ref(fwht(k.float() - mu), v, *ref, meta.slot_mapping, "HDN")
    for a, b in zip(caches, ref):
        _same(a, b, "store_kv_chunks(rotate=True)")
    # prompts with no cached prefix (every key the chunk store's), q rotated in the kernel
    q_lens = kv_lens = [21, 7, 30]
    meta = build_metadata(q_lens, kv_lens, _tables(kv_lens, ps, npg, 4), ps, "cpu")
    k = (torch.randn(sum(q_lens), h, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(sum(q_lens), h, d, generator=g).to(torch.bfloat16)
    store_kv_chunks(k, v, caches[0], caches[1], split_store_chunks(q_lens, kv_lens, ps, "cpu"),
                    meta.cu_seqlens_q, meta.kv_lens, meta.block_table, fmt,
                    k_scale_cache=caches[2], v_scale_cache=caches[3], k_mean=mu, rotate=True)
    q = (torch.randn(sum(q_lens), hq, d, generator=g) * 2).to(torch.bfloat16)
    cfg = PrefillConfig(32, 32, 4, 1)
    blocks = order_prefill_blocks(q_lens, hq // h, cfg.block_m, "cpu", kv_lens)
    scales = dict(k_scale_cache=caches[2], v_scale_cache=caches[3])
    outs = []
    for qq, rot in ((q, True), (fwht(q).to(torch.float16), False)):
        out = torch.full_like(q, float("nan"))
        paged_prefill(qq, caches[0], caches[1], meta.block_table, meta.cu_seqlens_q,
                      meta.kv_lens, blocks, cfg, out, d ** -0.5, v_t=True, rotate_q=rot,
                      **scales)
        outs.append(out.float())
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    if not err < 3e-3:  # NaN fails too
        raise AssertionError(f"paged_prefill(rotate_q=True) vs q @ H: relative error {err}")
    # the backend: prefill (fused rotation) then decode steps (rotation in torch here: no
    # RoPE kernel stores on CPU), against the torch reference backend
    for d, ps, npg, softcap in ((128, 32, 12, None), (128, 32, 12, 20.0), (64, 16, 20, None)):
        # the pool's V layout as the backend asks for it (token-minor for 8-bit heads >= 64;
        # 64-d decode then reads both KV heads in one program)
        means = [torch.randn(h, d, generator=g) * 6]
        pools = []
        for _ in range(2):
            pool = MHAKVCache([KVLayerSpec("full", h, d)], npg, ps, fmt, "cpu",
                              v_layout=TritonBackend.v_layout("int8", ps, d))
            pool.kv_transform = KVTransform(means, True, "cpu")
            pools.append(pool)
        be = TritonBackend(pools[0], torch.bfloat16, d ** -0.5, logit_softcap=softcap)
        rb = TorchRefBackend(pools[1], torch.bfloat16, d ** -0.5, logit_softcap=softcap)
        lens = [70, 9, 33]
        tables = _tables([n + 3 for n in lens], ps, npg, 3)
        for step in range(2):
            q_lens = lens if step == 0 else [1, 1, 1]
            kv_lens = lens if step == 0 else [n + step for n in lens]
            meta = build_metadata(q_lens, kv_lens, tables, ps, "cpu")
            t = sum(q_lens)
            q, k, v = (torch.randn(t, n, d, generator=g).to(torch.bfloat16) * 2
                       for n in (hq, h, h))
            k = k + means[0].to(torch.bfloat16)
            be.prepare(meta)
            rb.prepare(meta)
            out, ref = be.forward(q, k, v, 0).float(), rb.forward(q, k, v, 0).float()
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"rotating TritonBackend (d {d}, softcap {softcap}, "
                                     f"step {step}) vs the torch reference: relative "
                                     f"error {err}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    {"stores": check_stores, "attention": check_attention,
     "rotation": check_rotation}[sys.argv[1]]()
    print("ok", sys.argv[1])
