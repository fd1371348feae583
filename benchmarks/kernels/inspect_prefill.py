"""Compile prefill kernel variants for sm_90 without a GPU: registers, spills, shared memory, the
TTGIR ops that move data (layout conversions, shared-memory round trips, which MMA) and SASS
classes. Usage: python inspect_prefill.py [dump] [name filter ...]
(dump writes /tmp/prefill_<variant>.{ttgir,sass})"""

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
from kvfit.kernels import prefill  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
ARGS = ["Q", "KC", "VC", "BT", "CU", "KVLEN", "BLK", "OUT", "qk_scale", "softcap", "window",
        "v_scale", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cp", "stride_ch",
        "stride_bt"]


def compile_one(kv, consts, num_warps, num_stages):
    types = {"Q": "*bf16", "KC": f"*{kv}", "VC": f"*{kv}", "BT": "*i32", "CU": "*i32",
             "KVLEN": "*i32", "BLK": "*i32", "OUT": "*bf16", "qk_scale": "fp32",
             "softcap": "fp32", "window": "i32", "v_scale": "fp32"}
    sig = {a: types.get(a, "i32") for a in ARGS}
    attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(8)) + list(range(12, 19))}
    src = ASTSource(prefill.build(), sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps,
                                                        "num_stages": num_stages})


def res_usage(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                         capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                          text=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)) if reg else -1, int(stack.group(1)) if stack else -1, sass


def main():
    dump = "dump" in sys.argv[1:]
    base = dict(G=2, D=128, PAGE=32, HKV=8, HAS_SOFTCAP=False, HAS_WINDOW=False, PREC="tf32")
    variants = {
        "bf16 HND m64 n64 w4 s2": ("bf16", dict(base, PAGE=16, BLOCK_M=64, BLOCK_N=64, V_T=False,
                                                F16=False), 4, 2),
        "fp8 HND m128 n64 w8 s3": ("fp8e4nv", dict(base, BLOCK_M=128, BLOCK_N=64, V_T=False,
                                                   F16=True), 8, 3),
        "fp8 VT m128 n64 w8 s3": ("fp8e4nv", dict(base, BLOCK_M=128, BLOCK_N=64, V_T=True,
                                                  F16=True), 8, 3),
        "fp8 VT m64 n64 w4 s2": ("fp8e4nv", dict(base, BLOCK_M=64, BLOCK_N=64, V_T=True,
                                                 F16=True), 4, 2),
        "fp8 HND m64 n64 w4 s2": ("fp8e4nv", dict(base, BLOCK_M=64, BLOCK_N=64, V_T=False,
                                                  F16=True), 4, 2),
        # the chosen launches (prefill_config): 5 stages keep tile copies in flight
        "bf16 HND m128 n64 w8 s5": ("bf16", dict(base, PAGE=16, BLOCK_M=128, BLOCK_N=64,
                                                 V_T=False, F16=False), 8, 5),
        "fp8 VT m64 n64 w4 s5": ("fp8e4nv", dict(base, BLOCK_M=64, BLOCK_N=64, V_T=True,
                                                 F16=True), 4, 5),
    }
    only = [a for a in sys.argv[1:] if a != "dump"]
    for name, (kv, consts, nw, ns) in variants.items():
        if only and not any(o in name for o in only):
            continue
        try:
            k = compile_one(kv, consts, nw, ns)
        except Exception as e:
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:600]}")
            continue
        reg, stack, sass = res_usage(k)
        ttgir = k.asm["ttgir"]
        ir = collections.Counter()
        for op in ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store",
                   "ttng.warp_group_dot ", "tt.dot ", "ttg.async_copy_global_to_local",
                   "tt.trans", "tt.reshape", "ttg.memdesc_trans", "tt.fp_to_fp"):
            ir[op] = ttgir.count(op)
        ops = collections.Counter()
        for line in sass.splitlines():
            m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m:
                ops[m.group(1)] += 1
        keys = ("HGMMA", "HMMA", "LDGSTS", "LDG", "LDS", "LDSM", "STS", "STL", "LDL", "F2FP",
                "F2F", "PRMT", "MUFU", "SHFL", "BAR", "FSEL", "FMNMX", "FFMA", "FMUL", "FADD")
        waits = re.findall(r"async_wait .*?\{num = (\d+)", ttgir)
        print(f"{name}: regs={reg} stack={stack} smem={k.metadata.shared} "
              f"sass={sum(ops.values())} async_wait num={','.join(waits)}")
        print("    ir: " + " ".join(f"{o.split('.')[-1].strip()}={c}" for o, c in ir.items()))
        print("    sass: " + " ".join(f"{o}={ops[o]}" for o in keys))
        if dump:
            tag = name.replace(" ", "_")
            with open(f"/tmp/prefill_{tag}.ttgir", "w") as f:
                f.write(ttgir)
            with open(f"/tmp/prefill_{tag}.sass", "w") as f:
                f.write(sass)


if __name__ == "__main__":
    main()
