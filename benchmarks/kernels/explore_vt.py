"""Decode variants on the GPU: HND vs token-minor V pages, pipeline depth, tile, register cap.

For each variant: a correctness check against a float32 reference on a small ragged batch
(lengths off the page/tile size, a single token), then the occupancy of the compiled kernel
(registers, shared memory) -> the wave-aware split count, then the median time over rotating
copies of the cache at the benchmark points. Writes $OUT/explore_vt.json.
Usage: python explore_vt.py [quick|small]   (PAGE=32 in the environment: pages of 32 tokens;
small: the fp8 points that missed 3 TB/s, SmolLM2's 64-d heads and Llama's 8 x 16k)
"""

import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../src"))
from kvfit.bench.kernels_common import LAYOUTS, KVSet, rotating, copy_bandwidth  # noqa: E402
from kvfit.kernels import decode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def occupancy(kern, num_warps):
    """Resident programs per SM on sm_90 from the compiled kernel's registers and smem."""
    regs = max(1, kern.n_regs)
    warp_regs = math.ceil(regs * 32 / 256) * 256
    by_regs = 65536 // (warp_regs * num_warps)
    by_smem = (233472 // (kern.metadata.shared + 1024)) if kern.metadata.shared else 32
    return max(1, min(by_regs, by_smem, 64 // num_warps, 32))


def to_vt(c):
    """[pages, H, P, D] -> same storage order as [pages, H, D, P] (token-minor), same shape view
    semantics for the kernel: strides of page and head are unchanged."""
    return c.transpose(2, 3).contiguous()


PAGE = int(os.environ.get("PAGE", 16))


def check(cfg, hq, hkv, d, cache_dtype, page=PAGE):
    """(max relative error against float32, the compiled split kernel on CUDA else None)."""
    torch.manual_seed(1)
    lens = [1, 77, 300, 1000 + 5]
    g = hq // hkv
    pages = [-(-n // page) for n in lens]
    num_pages = sum(pages) + 3
    kvf = torch.randn(2, num_pages, hkv, page, d, device=DEV)
    kc, vc = kvf[0].to(cache_dtype), kvf[1].to(cache_dtype)
    perm = torch.randperm(num_pages, device=DEV).to(torch.int32)
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=DEV)
    i = 0
    for r, n in enumerate(pages):
        bt[r, :n] = perm[i:i + n]
        i += n
    q = torch.randn(len(lens), hq, d, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    kl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    vcache = to_vt(vc) if cfg.v_t else vc
    decode.paged_decode(q, kc, vcache, bt, kl, out, d ** -0.5, cfg, 0.7, 1.3)
    kern = (decode.compiled_split_kernel(q, kc, vcache, bt, kl, out, d ** -0.5, cfg)
            if DEV == "cuda" else None)
    errs = []
    for r, n in enumerate(lens):
        pg = bt[r, :pages[r]].long()
        k = kc[pg].float().transpose(1, 2).reshape(-1, hkv, d)[:n] * 0.7  # [n, hkv, d]
        v = vc[pg].float().transpose(1, 2).reshape(-1, hkv, d)[:n] * 1.3
        qq = q[r].float().view(hkv, g, d)
        s = torch.einsum("hgd,nhd->hgn", qq, k) * d ** -0.5
        o = torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(hq, d)
        errs.append(((out[r].float() - o).norm() / o.norm()).item())
    return max(errs), kern


def main():
    quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
    out_dir = os.environ.get("OUT", "/tmp")
    res = {"variants": []}
    if DEV == "cuda":
        res["copy_bw"] = copy_bandwidth(DEV)
        print(f"copy bw {res['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    fp8 = torch.float8_e4m3fn
    # (block_n, num_warps, num_stages, v_t, maxnreg)
    grid = {
        fp8: [(128, 4, 3, False, None), (64, 4, 5, True, 128), (64, 4, 6, True, 128),
              (64, 4, 7, True, 128), (64, 4, 5, True, 96), (64, 4, 6, True, 112),
              (32, 4, 6, True, 96), (32, 4, 8, True, 128), (128, 4, 5, True, 168)],
        torch.bfloat16: [(64, 4, 3, False, None), (64, 4, 5, True, None)],
    }
    points = {"qwen3-1.7b": [(32, 16384), (128, 4096), (8, 65536)],
              "llama-3.1-8b": [(32, 16384), (128, 16384)],
              "smollm2": [(32, 16384), (128, 4096), (128, 16384)]}
    if quick:
        grid = {k: v[:2] for k, v in grid.items()}
        points = {"qwen3-1.7b": [(2, 4096)]}
    if len(sys.argv) > 1 and sys.argv[1] == "small":
        grid = {fp8: [(128, 4, 3, False, None), (64, 4, 3, False, None), (64, 4, 5, True, 128),
                      (128, 4, 5, True, 128), (64, 4, 6, True, 128), (128, 4, 4, True, None),
                      (64, 4, 5, True, 96)]}
        points = {"smollm2": [(8, 16384), (32, 16384), (128, 4096), (128, 16384)],
                  "llama-3.1-8b": [(8, 16384)]}
    t0 = time.time()
    for layout, pts in points.items():
        hq, hkv, d = LAYOUTS[layout]
        for dt, variants in grid.items():
            name = "fp8_e4m3" if dt == fp8 else "bfloat16"
            sets = {}
            for bn, nw, ns, vt, mr in variants:
                if d == 64 and bn == 32:
                    continue
                base = decode.choose_config(1, hkv, hq // hkv, d, 1024, dt, torch.bfloat16,
                                            block_n=bn, num_warps=nw, num_stages=ns,
                                            maxnreg=mr, v_t=vt)
                try:
                    err, kern = check(base, hq, hkv, d, dt)
                except Exception as e:
                    print(f"{layout} {name} {(bn, nw, ns, vt, mr)} failed: {e}"[:300], flush=True)
                    continue
                occ = occupancy(kern, nw) if DEV == "cuda" else 2
                for b, ctx in pts:
                    if DEV != "cuda":
                        continue
                    key = (b, ctx)
                    if key not in sets:
                        kvs = KVSet(hkv, d, name, b, ctx, PAGE, DEV)
                        kvs.vt = [to_vt(c[1]) for c in kvs.caches]
                        sets[key] = kvs
                    kv = sets[key]
                    cfg = decode.choose_config(b, hkv, hq // hkv, d, ctx, dt, torch.bfloat16,
                                               block_n=bn, num_warps=nw, num_stages=ns,
                                               maxnreg=mr, v_t=vt, ctas_per_sm=occ)
                    qs = [torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
                          for _ in kv.caches]
                    outs = [torch.empty_like(x) for x in qs]
                    fns = [lambda i=i: decode.paged_decode(
                        qs[i], kv.caches[i][0], kv.vt[i] if vt else kv.caches[i][1],
                        kv.block_table, kv.kv_lens, outs[i], d ** -0.5, cfg)
                        for i in range(kv.reps)]
                    import triton
                    us = triton.testing.do_bench(rotating(fns), warmup=20, rep=100,
                                                 return_mode="median") * 1e3
                    timed = decode.compiled_split_kernel(
                        qs[0], kv.caches[0][0], kv.vt[0] if vt else kv.caches[0][1],
                        kv.block_table, kv.kv_lens, outs[0], d ** -0.5, cfg)
                    rec = dict(layout=layout, kv=name, page=PAGE, b=b, ctx=ctx, bn=bn, nw=nw,
                               ns=ns, vt=vt,
                               maxnreg=mr, regs=timed.n_regs,
                               smem=timed.metadata.shared, occ=occ,
                               splits=cfg.num_splits, err=err, us=us,
                               tbps=kv.bytes / us / 1e6)
                    res["variants"].append(rec)
                    print(f"{layout:>12} {name:>8} b={b:<3} ctx={ctx:<5} bn={bn:<3} w={nw} s={ns}"
                          f" vt={vt:d} mr={mr} regs={rec['regs']} smem={rec['smem']} occ={occ}"
                          f" splits={cfg.num_splits:<2} err={err:.1e} {us:7.1f} us"
                          f" {rec['tbps']:.2f} TB/s  [{time.time() - t0:.0f}s]", flush=True)
                if DEV != "cuda":
                    print(f"{layout} {name} {(bn, nw, ns, vt, mr)} err={err:.2e}", flush=True)
            del sets
            torch.cuda.empty_cache() if DEV == "cuda" else None
            with open(os.path.join(out_dir, "explore_vt.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
