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


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
    print("ok split")
