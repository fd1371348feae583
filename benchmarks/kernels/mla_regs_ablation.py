"""What bounds the register-operand MLA decode (kernels/mla_decode_fp8_regs.py): the kernel timed
whole and with one part taken out at a time, in one process, so each part's share of a tile's
time is the difference (timing only: the ablated kernels compute wrong values). Prints one
table of µs and latent TB/s (% of the measured copy bandwidth) per point and variant.

Variants (each a copy of the kernel's source with one rewrite, checked to apply):
  full          the kernel as shipped
  no-logits     the logits' 36 warp-group MMAs not issued (the softmax sees constant logits;
                the rope chunk is stored to shared memory so that its bytes are still read)
  no-pv         the 32 P . latent MMAs not issued (the accumulators are only rescaled)
  prmt-convert  the conversion by two prmt a word (a byte under a float16's high byte) instead
                of two cvt
  no-store      the latent's float16 blocks not written to shared memory
  tile-sum      the softmax's running sum reduced down the tokens every tile (across the four
                warps) instead of once after the loop (twenty-third session)
  rows-in-tile  the block-table entries of the next tile loaded in the tile that uses them
                instead of a tile earlier (twenty-third session)
  gluon-max     the tile's maximum by Gluon's reduction across warps (two barriers, a second
                round of shuffles) instead of one exchange through shared memory (_tile_max)
  ld-sunk       the next tile's chunk loads placed among the logits steps, chunk j's after its
                conversion (in the source: ptxas gathers them before the maximum's exchange)
  ld-pv         the next tile's chunk loads placed after the P . latent MMAs are issued
  ld-split      chunks 0-3 loaded where the kernel loads them (after the exchange), 4-8 after
                the P . latent MMAs are issued (the first chunks keep the longest window, the
                rest leave the MIO queue to P's store and the MMAs; not yet measured)
  no-tail-barrier  the barrier after each tile's P . latent left out (timing only: whether the
                warp-group MMA's wait alone orders the next tile's shared-memory stores is not
                proven, so the shipped kernel keeps it)
  mma-sync      a candidate, not an ablation: the same kernel with warp-level mma.sync
                m16n8k16 (Gluon's mma_v2: the query and the latent blocks by ldmatrix) in
                place of the 68 warp-group MMAs of N = 16 (docs/kernels.md, the MLA section's
                next form); its output is checked against the shipped kernel's

    python3 benchmarks/kernels/mla_regs_ablation.py --points fp8_e4m3:32:16384,fp8_e4m3:4:32768
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import tempfile

_PV = ("            o{j} = _pv(o{j}, c{j}.index(z), p_s, alpha)\n",
       "            o{j} = o{j} * alpha[None, :]\n")


_MMA_SYNC = [
    ("""    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 16])""",
     """    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, 8])"""),
    ("""        globals()[name] = mha_decode_parts()[name]
""", """        globals()[name] = mha_decode_parts()[name]
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    globals()["mma_v2"] = mma_v2
"""),
    ("""        s_t = warpgroup_mma(a, q_j.permute((1, 0)), s_t, is_async=True)  # noqa: F821
        s_t, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, a_prev))  # noqa: F821
""", """        LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_t.type.layout,
                                               k_width=2)
        s_t = mma_v2(a, q_j.permute((1, 0)).load(LB), s_t)  # noqa: F821
"""),
    ("""        return warpgroup_mma(lat_j.permute((1, 0)), p_s, acc * alpha[None, :],  # noqa: F821
                             is_async=True)""",
     """        LA2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                k_width=2)
        LB2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc.type.layout,
                                                k_width=2)
        return mma_v2(lat_j.permute((1, 0)).load(LA2), p_s.load(LB2),  # noqa: F821
                      acc * alpha[None, :])"""),
    ("""            s_t = warpgroup_mma(a, q_c.index(z).permute((1, 0)), s_zero, use_acc=False,  # noqa: F821
                                is_async=True)""",
     """            LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
            s_t = mma_v2(a, q_c.index(z).permute((1, 0)).load(LB), s_zero)  # noqa: F821"""),
    ("""            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, a))[0]  # noqa: F821
""", ""),
    ("""            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(  # noqa: F821
                num_outstanding=0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
""", ""),
]
VARIANTS = ("full", "tile-sum", "rows-in-tile", "gluon-max", "ld-sunk", "ld-pv", "ld-split",
            "no-tail-barrier", "no-logits", "no-pv", "prmt-convert", "no-store", "mma-sync")
# variants meant to be right
EXACT = ("full", "mma-sync", "tile-sum", "rows-in-tile", "gluon-max", "ld-sunk", "ld-pv",
         "ld-split")
_SUM_PER_TILE = [
    ("""        l_t = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=MMA)
""", """        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, MMA))
"""),
    ("""            l_t = l_t * alpha[None, :] + p_t
""", """            l_i = l_i * alpha + gl.sum(p_t, axis=0)
"""),
    ("""        l_i = gl.sum(l_t, axis=0)
""", ""),
]
_ROWS_IN_TILE = [
    ("""            rows = _rows(pg, n0 + BLOCK_N, hi, stride_cp, SLAB, PAGE, LW)
            pg = _pages(bt_row, n0 + 2 * BLOCK_N, hi, PAGE, LW)
""", """            rows = _rows(_pages(bt_row, n0 + BLOCK_N, hi, PAGE, LW), n0 + BLOCK_N, hi, stride_cp,
                         SLAB, PAGE, LW)
"""),
]
_LOADS = "            x0, x1, x2, x3, x4, x5, x6, x7, x8 = _chunks(Cw, rows, LW)\n"


_SHIPPED_LOADS = "            p_s.store(p_t.to(F16))\n"  # the loads' block is just before it
_STEPS = ["""            s_t = warpgroup_mma(a, q_c.index(z).permute((1, 0)), s_zero, use_acc=False,  # noqa: F821
                                is_async=True)
"""] + [f"            s_t, a = _logits_step(x{j + 1}, s_t, a, q_c.index(z + {j + 1}), c{j + 1}.index(z), "
        "True, LA, ASM)\n" for j in range(7)] + [
    "            s_t, a = _logits_step(x8, s_t, a, q_r.index(z), c0, False, LA, ASM)\n"]


def _loads_moved(anchor: str | None) -> list[tuple[str, str]]:
    # the nine chunk loads of the next tile out of their block, placed before anchor (None:
    # chunk j's after the logits step that converts chunk j)
    out = [(_LOADS + _SHIPPED_LOADS, _SHIPPED_LOADS)]
    if anchor is not None:
        return out + [(anchor, _LOADS + anchor)]
    return out + [(step, step + f"            x{j} = _chunk(Cw, rows, {j}, LW)\n")
                  for j, step in enumerate(_STEPS)]


def _rewrites(name: str) -> list[tuple[str, str]]:
    if name == "mma-sync":
        return _MMA_SYNC
    if name == "tile-sum":
        return _SUM_PER_TILE
    if name == "rows-in-tile":
        return _ROWS_IN_TILE
    if name == "gluon-max":
        return [("_tile_max(s_t, mx_s, MMA, True)", "_tile_max(s_t, mx_s, MMA, False)")]
    if name == "ld-sunk":
        return _loads_moved(None)
    if name == "ld-split":
        head = "".join(f"            x{j} = _chunk(Cw, rows, {j}, LW)\n" for j in range(4))
        tail = "".join(f"            x{j} = _chunk(Cw, rows, {j}, LW)\n" for j in range(4, 9))
        pv = "            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait("
        return [(_LOADS + _SHIPPED_LOADS, head + _SHIPPED_LOADS), (pv, tail + pv)]
    if name == "ld-pv":
        return _loads_moved("            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(")
    if name == "no-tail-barrier":
        return [("""            _cta_barrier()  # noqa: F821 -- every warp's P . latent has read the blocks and p
""", "")]
    if name == "no-logits":
        return [("        s_t = warpgroup_mma(a, q_j.permute((1, 0)), s_t, is_async=True)  "
                 "# noqa: F821\n        s_t, a_prev = warpgroup_mma_wait(num_outstanding=1, "
                 "deps=(s_t, a_prev))  # noqa: F821\n", ""),
                ("            s_t = warpgroup_mma(a, q_c.index(z).permute((1, 0)), s_zero, "
                 "use_acc=False,  # noqa: F821\n                                is_async=True)\n",
                 "            s_t = s_zero + n0.to(gl.float32)\n"),
                ("            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, a))[0]  "
                 "# noqa: F821\n", ""),
                # the rope chunk, whose only use was its MMA, stored (into block 0) so that its
                # loads stay: the same bytes read, 8 KB more shared-memory stores a tile
                ("q_r.index(z), c0, False, LA, ASM)", "q_r.index(z), c0.index(z), True, LA, ASM)")]
    if name == "no-pv":
        return [(_PV[0].format(j=j), _PV[1].format(j=j)) for j in range(8)] + [
            ("            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(  # noqa: F821\n"
             "                num_outstanding=0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))\n", "")]
    if name == "prmt-convert":
        return [('        o = gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,r"',
                 '        o = gl.inline_asm_elementwise("{\\n.reg .b32 a, b;\\n'
                 'prmt.b32 a, $4, 0, 0x1404;\\nprmt.b32 b, $4, 0, 0x3424;\\n'
                 'mov.b32 {$0, $1}, a;\\nmov.b32 {$2, $3}, b;\\n}", "=h,=h,=h,=h,r"')]
    if name == "no-store":
        return [("            lat_j.store(f)\n", "            pass\n"),
                ("            c0.index(z).store(f)\n", "")]
    return []


def variant_build(name: str, workdir: str):
    """(``build``, ``layouts``) of a copy of the kernel module with ``name``'s rewrites (each
    must apply): the launch takes both from the module, so a variant with other layouts (the
    mma-sync one) must replace both."""
    from kvfit.kernels import mla_decode_fp8_regs

    if name == "full":
        return mla_decode_fp8_regs.build, mla_decode_fp8_regs.layouts
    src = inspect.getsource(mla_decode_fp8_regs)
    for old, new in _rewrites(name):
        if old not in src:
            raise RuntimeError(f"{name}: the kernel changed, rewrite not found: {old[:60]!r}")
        src = src.replace(old, new)
    path = os.path.join(workdir, f"mla_regs_{name.replace('-', '_')}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build, mod.layouts


def _output(ls, heads: int, cfg):
    """The decode's output for a fixed query over copy 0 of the cache."""
    import torch

    from kvfit.kernels.mla import mla_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ls.batch, heads, ls.slab, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.full((ls.batch, heads, ls.rank), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    cu = torch.arange(ls.batch + 1, dtype=torch.int32, device="cuda")
    mla_decode(q, ls.caches[0], ls.block_table, cu, ls.kv_lens, out, ls.rank, 0.1, cfg)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="fp8_e4m3:32:16384,fp8_e4m3:4:32768")
    p.add_argument("--variants",
                   default=",".join(VARIANTS))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rep", type=int, default=60, help="do_bench ms per timing")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from kvfit.bench.kernels_common import copy_bandwidth
    from kvfit.bench.kernels_mla import LatentSet, time_mla_decode
    from kvfit.kernels import mla_decode_fp8_regs, mla_gluon
    from kvfit.kernels.mla import decode_config

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    shipped = mla_decode_fp8_regs.build, mla_decode_fp8_regs.layouts
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        builds = {v: variant_build(v, workdir) for v in args.variants.split(",")}
        for point in args.points.split(","):
            kvd, b, ctx = point.split(":")
            b, ctx = int(b), int(ctx)
            ls = LatentSet(512, 64, kvd, b, ctx, 32, "cuda")
            cfg = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16, gluon=True,
                                regs=True)
            full = None
            ref = None
            for v, (build, layouts) in builds.items():
                mla_decode_fp8_regs.build, mla_decode_fp8_regs.layouts = build, layouts
                try:
                    us = time_mla_decode(ls, args.heads, cfg, rep=args.rep)
                    if mla_gluon._failures:  # it did not compile: the Triton kernels ran
                        print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} {v:>13} did not compile: "
                              f"{mla_gluon._failures[0]}", flush=True)
                        mla_gluon._failures.clear()
                        continue
                    err = ""
                    if v in EXACT:  # the output on one fixed query against the shipped kernel's
                        got = _output(ls, args.heads, cfg)
                        ref = got if ref is None else ref
                        rel = ((got.float() - ref.float()).abs().max()
                               / ref.float().abs().max()).item()
                        err = f"  rel err vs shipped {rel:.1e}" + (
                            "" if rel < 2e-2 and not got.isnan().any() else "  WRONG")
                finally:
                    mla_decode_fp8_regs.build, mla_decode_fp8_regs.layouts = shipped
                full = us if v == "full" else full
                pct = 100 * ls.bytes / (us * 1e-6) / bw
                rows.append(dict(kv_dtype=kvd, batch=b, context=ctx, variant=v, us=us,
                                 pct_copy=pct))
                share = f"  {full - us:+7.1f} us vs full" if full is not None else ""
                print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} {v:>13} splits={cfg.num_splits:<3} "
                      f"{us:8.1f} us ({pct:4.0f}% of copy){share}{err}", flush=True)
            del ls
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
