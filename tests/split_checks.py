"""Split-KV extend (kernels/prefill_split.py) under the Triton interpreter (CPU tensors), run by
tests/test_prefill_split.py in a subprocess with ``TRITON_INTERPRET=1``.

For each KV format the triton backend stores (bfloat16, fp8_e4m3, int8) and both V layouts:
a mixed extend batch (short extends over long cached contexts, a fresh prompt, a decode token)
through ``paged_prefill`` with and without key splits, against a float32 reference over the
dequantized pages; the split output is checked bit-equal between the eager grid and a padded
(spare-program) grid. Outputs start as NaN. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import random
import sys

import torch


def _tables(kv_lens, ps, num_pages, seed):
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    out, i = [], 0
    for n in kv_lens:
        m = -(-n // ps)
        out.append(pages[i:i + m])
        i += m
    return out


def main():
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.torch_attend import attend
    from kvfit.kernels.prefill import PrefillConfig, order_prefill_blocks, paged_prefill
    from kvfit.kernels.prefill_split import ExtendSplit
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    hq, hkv, d, ps = 4, 2, 64, 16
    cfg = PrefillConfig(32, 32, 4, 1)
    q_lens = [5, 9, 12, 1]
    kv_lens = [150, 9, 110, 40]  # extends over 145 and 98 cached tokens, a prompt, a decode
    for name, v_layout in (("float16", "HND"), ("fp8_e4m3", "HDN"), ("int8", "HDN"),
                           ("int8", "HND")):
        fmt = kv_format(name)
        npg = sum(-(-n // ps) for n in kv_lens) + 2
        pool = MHAKVCache([KVLayerSpec("full", hkv, d)], npg, ps, fmt, "cpu", v_layout=v_layout)
        tables = _tables(kv_lens, ps, npg, seed)
        full = build_metadata(kv_lens, kv_lens, tables, ps, "cpu")
        pool.store_kv(0, torch.randn(sum(kv_lens), hkv, d), torch.randn(sum(kv_lens), hkv, d),
                      full.slot_mapping)
        meta = build_metadata(q_lens, kv_lens, tables, ps, "cpu")
        q = torch.randn(sum(q_lens), hq, d).to(torch.float16)
        ref = torch.empty(q.shape)
        start = 0
        for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            kk, vv = pool.gather_kv(0, meta.block_table[i, :meta.num_pages_cpu[i]], kl,
                                    torch.float32)
            ref[start:start + ql] = attend(q[start:start + ql].float(), kk, vv, d ** -0.5)
            start += ql
        blocks = order_prefill_blocks(q_lens, hq // hkv, cfg.block_m, "cpu", kv_lens)
        kw = dict(v_t=v_layout == "HDN")
        if fmt.torch_dtype == torch.int8:
            kw.update(k_scale_cache=pool.k_scale_caches[0], v_scale_cache=pool.v_scale_caches[0])
        args = (q, pool.k_caches[0], pool.v_caches[0], meta.block_table, meta.cu_seqlens_q,
                meta.kv_lens)
        outs = {}
        for label, min_tiles in (("plain", None), ("split", 1)):
            split = None
            if min_tiles is not None:
                split = ExtendSplit()
                split.min_tiles = min_tiles
            out = torch.full_like(q, float("nan"))
            paged_prefill(*args, blocks, cfg, out, d ** -0.5, pool.k_scales[0], pool.v_scales[0],
                          split=split, **kw)
            outs[label] = out
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 8e-3:  # NaN fails too
                raise AssertionError(f"{name} {v_layout} {label}: relative error {err}")
        # a padded grid (spare blocks of request -1, extra rows) gives the same bits
        split = ExtendSplit()
        split.min_tiles = 1  # 32-token tiles: up to 5 splits of one tile each
        pad_blocks = torch.cat([blocks, torch.tensor([[-1, 0]] * 3, dtype=torch.int32)])
        pad_q = torch.cat([q, torch.randn(3, hq, d).to(q.dtype)])
        out = torch.full_like(pad_q, float("nan"))
        paged_prefill(pad_q, *args[1:], pad_blocks, cfg, out, d ** -0.5, pool.k_scales[0],
                      pool.v_scales[0], split=split, **kw)
        if not torch.equal(out[:q.shape[0]], outs["split"]):
            raise AssertionError(f"{name} {v_layout}: a padded grid changed the split output")
        print(name, v_layout, "ok", flush=True)


def check_graph_step():
    """A prefill graph's step without the graph: the triton backend prepared from the padded
    static buffers of ``PrefillStaging`` (spare programs and chunks, padded tokens and
    requests) writes the same pool bytes and the same output bits as the eager step, for a
    token-minor fp8 pool (chunked V store) and an int8 HND pool (slot-mapped store)."""
    from kvfit.attention.meta_builder import build_metadata
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.engine.prefill_graph import MAX_REQS
    from kvfit.engine.prefill_staging import PrefillStaging
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    from kvfit.kernels import prefill_split

    prefill_split.EAGER_SPLIT = True  # the eager step splits as the graph step does
    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    hq, hkv, d, ps = 4, 2, 64, 16
    q_lens, kv_lens = [12, 1, 9], [140, 40, 9]
    t = sum(q_lens)
    for name, v_layout in (("fp8_e4m3", "HDN"), ("int8", "HND")):
        npg = sum(-(-n // ps) for n in kv_lens) + 2
        tables = _tables(kv_lens, ps, npg, seed)
        pools = [MHAKVCache([KVLayerSpec("full", hkv, d)], npg, ps, kv_format(name), "cpu",
                            v_layout=v_layout) for _ in range(2)]
        pre = [kv - q for q, kv in zip(q_lens, kv_lens)]
        full = build_metadata(pre, pre, tables, ps, "cpu")
        k0, v0 = torch.randn(sum(pre), hkv, d), torch.randn(sum(pre), hkv, d)
        for p in pools:
            for c in (*p.k_caches, *p.v_caches, *p.k_scale_caches, *p.v_scale_caches):
                c.view(torch.uint8).fill_(0x55)  # same poison in both pools
            p.store_kv(0, k0, v0, full.slot_mapping)
        q = torch.randn(t, hq, d).to(torch.float16)
        k = torch.randn(t, hkv, d).to(torch.float16)
        v = torch.randn(t, hkv, d).to(torch.float16)
        eager = TritonBackend(pools[0], torch.float16, d ** -0.5)
        eager.extend_split.min_tiles = 2  # contexts over 2 tiles split (64-token tiles)
        eager.prepare(build_metadata(q_lens, kv_lens, tables, ps, "cpu"))
        if not eager._split_step:
            raise AssertionError("the eager step should split its keys")
        out_e = eager.forward(q, k, v, 0)
        graph = TritonBackend(pools[1], torch.float16, d ** -0.5)
        graph.extend_split.min_tiles = 2
        bucket = 32
        st = PrefillStaging(64, MAX_REQS, 16, ps, hq // hkv, graph.prefill_graph_block_m(),
                            "cpu")
        st.stage([3, 3], [50, 45], tables[:2], 64, True)  # an earlier, larger step's leftovers
        n_pages = st.stage(q_lens, kv_lens, tables, bucket, v_layout == "HDN")
        from kvfit.attention.base import AttentionMetadata

        pad = [0] * (MAX_REQS - len(q_lens))
        meta = AttentionMetadata(st.cu_seqlens, st.kv_lens, st.block_table,
                                 st.slot_mapping[:bucket], q_lens + pad, kv_lens + pad, n_pages,
                                 False, len(q_lens))
        nb, nc = st.grid(bucket)
        graph.prepare_prefill_graph(meta, st.blocks[:nb], st.chunks[:nc], hq // hkv)
        extra = bucket - t
        out_g = graph.forward(torch.cat([q, torch.randn(extra, hq, d).to(q.dtype)]),
                              torch.cat([k, torch.randn(extra, hkv, d).to(k.dtype)]),
                              torch.cat([v, torch.randn(extra, hkv, d).to(v.dtype)]), 0)
        for a, b in zip((*pools[0].k_caches, *pools[0].v_caches, *pools[0].k_scale_caches),
                        (*pools[1].k_caches, *pools[1].v_caches, *pools[1].k_scale_caches)):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                raise AssertionError(f"{name} {v_layout}: the padded step stored other bytes")
        if not torch.equal(out_g[:t], out_e):
            raise AssertionError(f"{name} {v_layout}: the padded step's output differs")
        if torch.isnan(out_e.float()).any():
            raise AssertionError(f"{name} {v_layout}: NaN in the output")
        print("graph step", name, v_layout, "ok", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
    check_graph_step()
    print("ok split")
