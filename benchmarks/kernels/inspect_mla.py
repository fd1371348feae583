"""Compile the MLA attention kernel variants for sm_90 without a GPU: registers, spills, shared
memory and the SASS instruction mix (MMAs, conversions, loads), per (KV dtype, mode, tile).
Usage: python inspect_mla.py [bn:warps:stages | KIND:bn:warps:stages (swapped decode, KIND s, sq
       (fp8 logits), sp (register prefetch), sqp) |
       p:bm:bn:warps:stages ...]   (default: decode_config/prefill_config's)"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../src"))
import torch  # noqa: E402

from kvfit.kernels import mla_kernels  # noqa: E402
from kvfit.kernels.mla import decode_config, prefill_config  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
DT = {"bfloat16": "bf16", "fp8_e4m3": "fp8e4nv", "fp8_e5m2": "fp8e5"}
TORCH = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def sig(kv):
    names = ["Q", "C", "BT", "CU", "KVLEN", "BLK", "OUT", "OP", "LSE", "qk_scale", "out_scale",
             "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cp", "stride_bt",
             "num_splits"]
    types = ["*bf16", f"*{kv}", "*i32", "*i32", "*i32", "*i32", "*bf16", "*fp32", "*fp32",
             "fp32", "fp32"] + ["i32"] * 7
    return dict(zip(names, types))


def compile_one(kv, decode, single, bm, bn, warps, stages, heads=16):
    attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(9)) + list(range(11, 17))}
    consts = dict(H=heads, RANK=512, ROPE=64, DC=512, DR=64, SLAB=576, PAGE=32 if kv != "bf16"
                  else 16, BLOCK_M=bm, BLOCK_N=bn, HBLK=max(1, heads // bm), DECODE=decode,
                  SINGLE=single, F16=kv != "bf16", PREC="tf32",
                  PAIRS=kv != "bf16" and os.environ.get("PAIRS", "1") == "1", E5M2=kv == "fp8e5",
                  ASM=True)
    src = ASTSource(mla_kernels.build()[0], sig(kv), constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps,
                                                        "num_stages": stages})


def compile_swap(kv, single, bh, bn, warps, stages, heads=16, qfp8=False, prefetch=False,
                 hoist=0):
    """The swapped decode kernel (mla_decode_kernels) for sm_90."""
    from kvfit.kernels import mla_decode_kernels

    names = ["Q", "C", "BT", "KVLEN", "OUT", "OP", "LSE", "qk_scale", "out_scale", "stride_qt",
             "stride_qh", "stride_ot", "stride_oh", "stride_cp", "stride_bt", "num_splits"]
    types = ["*bf16", f"*{kv}", "*i32", "*i32", "*bf16", "*fp32", "*fp32", "fp32", "fp32"] + [
        "i32"] * 7
    attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(7)) + list(range(9, 15))}
    consts = dict(H=heads, RANK=512, ROPE=64, DC=512, DR=64, SLAB=576,
                  PAGE=32 if kv != "bf16" else 16, BLOCK_H=bh, BLOCK_N=bn,
                  HBLK=max(1, heads // bh), SINGLE=single, F16=kv != "bf16",
                  PAIRS=kv != "bf16", E5M2=kv == "fp8e5", ASM=True,
                  QFP8=qfp8 and kv == "fp8e4nv", PREFETCH=prefetch, HOIST=hoist,
                  MAXP_POW2=max(16, 1 << (hoist * bn // (32 if kv != "bf16" else 16)
                                          + 1).bit_length()))
    src = ASTSource(mla_decode_kernels.build(), dict(zip(names, types)), constexprs=consts,
                    attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps,
                                                        "num_stages": stages})


def report(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                         capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name],
                          capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
            ops[m.group(1)] += 1
    regs = re.search(r"REG:(\d+)", res)
    spill = "STL" in ops
    keep = ("HMMA", "HGMMA", "QGMMA", "F2FP", "F2F", "LDGSTS", "LDG", "LDS", "LDS.U8", "LDS.U16",
            "LDSM", "STS", "MUFU", "PRMT", "BAR")
    mix = " ".join(f"{o}={ops[o]}" for o in keep if ops[o])
    return (f"regs={regs.group(1) if regs else '?'} smem={k.metadata.shared} "
            f"spills={'YES' if spill else 'no'} {mix}")


def main():
    variants = sys.argv[1:]
    for kvd in os.environ.get("KVDS", "bfloat16,fp8_e4m3").split(","):
        kv = DT[kvd]
        d = decode_config(4, 16, 512, 32768, TORCH[kvd], torch.bfloat16)
        p = prefill_config(16, TORCH[kvd], torch.bfloat16)
        first = ("swap-" + "s" + "q" * d.qfp8 + "h" * (d.hoist > 0)) if d.swap else "decode"
        runs = [(first, True, False, d.block_m, d.block_n, d.num_warps, d.num_stages),
                ("prefill", False, True, p.block_m, p.block_n, p.num_warps, p.num_stages)]
        for v in variants:
            if v.startswith("p:"):  # prefill p:block_m:block_n:warps:stages
                bm, bn, w, st = map(int, v[2:].split(":"))
                runs.append(("prefill", False, True, bm, bn, w, st))
                continue
            if not v[0].isdigit():  # swapped decode KIND:block_n:warps:stages (s, sq, sp, sqp)
                kind, rest = v.split(":", 1)
                bn, w, st = map(int, rest.split(":"))
                runs.append(("swap-" + kind, True, False, d.block_m, bn, w, st))
                continue
            bn, w, st = map(int, v.split(":"))
            runs.append(("decode", True, False, d.block_m, bn, w, st))
        for name, dec, single, bm, bn, w, st in runs:
            try:
                k = (compile_swap(kv, single, bm, bn, w, st, qfp8="q" in name[5:],
                                  prefetch="p" in name[5:],
                                  hoist=max(1, 1024 // bn) if "h" in name[5:] else 0)
                     if name.startswith("swap") else compile_one(kv, dec, single, bm, bn, w, st))
                print(f"{kvd:>9} {name:>7} bm={bm} bn={bn} w={w} st={st}: {report(k)}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{kvd:>9} {name:>7} bm={bm} bn={bn} w={w} st={st}: FAILED "
                      f"{type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
