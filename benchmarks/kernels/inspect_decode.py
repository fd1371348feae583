"""Compile our decode kernel variants for sm_90 without a GPU and count what the inner loop does
(registers, shared memory, SASS instruction classes). Usage: python inspect_decode.py [dump]"""

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
from kvfit.kernels import decode_kernels  # noqa: E402

split_k, merge_k, split_fma = decode_kernels.build()
TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sig(kv, q="bf16"):
    # the split kernels' runtime arguments, in order (kernels/decode_kernels.py)
    return {"Q": f"*{q}", "KC": f"*{kv}", "VC": f"*{kv}", "KS": "*fp16", "VS": "*fp16",
            "QB": f"*{q}", "BT": "*i32", "KVLEN": "*i32", "OUT": f"*{q}", "OP": "*fp32",
            "LSE": "*fp32", "qk_scale": "fp32", "softcap": "fp32", "window": "i32",
            "v_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
            "stride_oh": "i32", "stride_cp": "i32", "stride_ch": "i32", "stride_sp": "i32",
            "stride_sh": "i32", "stride_bt": "i32", "stride_qb": "i32", "num_splits": "i32",
            "min_per": "i32", "CNT": "*i32"}


MERGE_SIG = {"OP": "*fp32", "LSE": "*fp32", "OUT": "*bf16", "KVLEN": "*i32", "v_scale": "fp32",
             "stride_ot": "i32", "stride_oh": "i32", "num_splits": "i32", "min_per": "i32",
             "window": "i32", "HQ": "i32"}


def _full(fn, runtime: dict, consts: dict) -> tuple[dict, dict]:
    """Triton >= 3.4 wants every argument in the signature (constexprs typed "constexpr"),
    defaults included: (signature, constexprs)."""
    consts = {**{n: False for n in ("PDL",) if n in fn.arg_names}, **consts}
    for name, default in (("K_CVT", 0), ("FUSED", False), ("S_PAD", 1)):
        if name in fn.arg_names and name not in consts:
            consts[name] = default
    return {n: runtime.get(n, "constexpr") for n in fn.arg_names}, consts


def compile_one(fn, kv, consts, num_warps=4, num_stages=3, maxnreg=None):
    if fn is merge_k:
        s, c = _full(fn, MERGE_SIG, consts)
        return triton.compile(ASTSource(fn, s, constexprs=c), target=TARGET,
                              options={"num_warps": num_warps})
    # pointers, and the q/out/cache/scale strides the JIT marks divisible by 16 in every launch
    # (multiples of the head and page sizes): the hint decides vectorised and async loads
    attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(11)) + list(range(15, 23))}
    s, c = _full(fn, sig(kv), consts)
    src = ASTSource(fn, s, constexprs=c, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=opts)


def regs(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                         capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else -1


def sass_counts(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                         text=True).stdout
    ops = collections.Counter()
    for line in out.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops, out


def main():
    base = dict(G=2, G_PAD=16, D=128, PAGE=16, HAS_SOFTCAP=False, HAS_WINDOW=False, SINGLE=False,
                ROWS=False, I8_CVT=0, HAS_QBIAS=False)
    variants = {
        "bf16 HND bn64": (split_k, "bf16", dict(base, BLOCK_N=64, F16=False, V_T=False), 4, 3, None),
        "fp8 HND bn128": (split_k, "fp8e4nv", dict(base, BLOCK_N=128, F16=True, V_T=False), 4, 3,
                          None),
        "fp8 token-minor V bn64 s5 r128": (split_k, "fp8e4nv", dict(base, BLOCK_N=64, F16=True,
                                                                    V_T=True), 4, 5, 128),
        "fp8 fma bn16": (split_fma, "fp8e4nv", {**{k: v for k, v in base.items() if k != "I8_CVT"},
                                                 "G_PAD": 2, "BLOCK_N": 16, "V_T": False}, 4, 2,
                         None),
        "merge, live splits": (merge_k, None, dict(D=128, S_PAD=64, LIVE=True, BLOCK_N=64,
                                                   HAS_WINDOW=True), 4, 1, None),
    }
    dump = len(sys.argv) > 1
    for name, (fn, kv, consts, nw, ns, mr) in variants.items():
        try:
            k = compile_one(fn, kv, consts, nw, ns, mr)
        except Exception as e:
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}")
            continue
        ops, sass = sass_counts(k)
        keys = ("LDG", "LDS", "STS", "MMA", "F2F", "HADD2", "HMUL2", "PRMT", "FFMA", "FMUL",
                "FADD", "MUFU", "SHFL", "BAR", "LOP3", "IMAD", "SEL", "FSEL", "FMNMX")
        agg = collections.Counter()
        for op, c in ops.items():
            for key in keys:
                if key in op.split(".")[0] or (key == "MMA" and "MMA" in op):
                    agg[op] += c
                    break
        print(f"{name}: smem={k.metadata.shared} regs={regs(k)} total={sum(ops.values())}")
        print("    " + " ".join(f"{o}={c}" for o, c in sorted(agg.items())))
        if dump:
            with open(f"/tmp/sass_{name.replace(' ', '_')}.txt", "w") as f:
                f.write(sass)
            with open(f"/tmp/ttgir_{name.replace(' ', '_')}.txt", "w") as f:
                f.write(k.asm["ttgir"])


if __name__ == "__main__":
    main()
