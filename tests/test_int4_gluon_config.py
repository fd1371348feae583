"""The Gluon int4 decode on the CPU: its launch choices (``choose_config(gluon=True)``), the
inputs it refuses with a clear error, the argument binding of its launch, the fallback to the
Triton kernel when the installed Triton cannot compile it, and its source compiled for sm_90
(nothing executes here: tests/gpu/test_int4_decode.py proves it against the float64
reference on the GPU)."""

from __future__ import annotations

import pytest
import torch

from gluon_launch_fakes import Broken, Recording
from kvfit.kernels import decode_int4
from kvfit.kernels.decode_int4 import Int4DecodeConfig, choose_config, int4_decode

from int4_kernel_check import decode_problem as _problem


def test_gluon_launch_choices_per_head_size():
    for d, (stages, per_sm, maxnreg) in decode_int4.GLUON_TILES.items():
        cfg = choose_config(64, 8, d, 2048, 132, gluon=True)
        assert cfg.gluon and cfg.pages_per_tile == 2 and cfg.num_warps == 4
        assert (cfg.num_stages, cfg.maxnreg) == (stages, maxnreg)
    # 128-d: 4 programs an SM in the split rule: 512 programs fill 528 slots once
    assert choose_config(64, 8, 128, 2048, 132, gluon=True).num_splits == 1
    assert choose_config(16, 8, 128, 8192, 132, gluon=True).num_splits == 4
    assert choose_config(16, 8, 128, 8192, 132, num_stages=3, gluon=True).num_stages == 3
    assert not choose_config(16, 8, 128, 8192, 132).gluon


def test_gluon_refuses_float32_naming_the_fix():
    q, pool, bt, lens, slots = _problem(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="gluon=False"):
        int4_decode(q, pool, 0, bt, lens, slots, torch.empty_like(q), 0.125,
                    Int4DecodeConfig(1, gluon=True))


def test_gluon_launch_binds_every_kernel_argument(monkeypatch):
    """``int4_decode`` passes the Gluon kernel exactly its parameters (bound against the jitted
    function's signature): the grid (requests, KV heads, splits), the strides of the codes,
    scales and residual, and the constexprs."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from kvfit.kernels import decode_int4_gluon

    real = decode_int4_gluon.build()
    calls = []

    monkeypatch.setattr(decode_int4_gluon, "build", Recording(real, calls))
    monkeypatch.setattr(decode_int4, "_gluon_failures", [])
    q, pool, bt, lens, slots = _problem()
    out = torch.empty_like(q)
    int4_decode(q, pool, 0, bt, lens, slots, out, 0.125,
                Int4DecodeConfig(1, 2, 4, 2, maxnreg=128, gluon=True))
    (grid, a), = calls
    assert grid == (3, 2, 1)
    assert a["Q"] is q and a["OUT"] is out and a["KC"] is pool.k_caches[0]
    assert a["KS"] is pool.k_scale_caches[0] and a["VZ"] is pool.v_zero_caches[0]
    assert a["stride_cp"] == pool.k_caches[0].stride(0) == 2 * 32 * 32
    assert a["stride_vp"] == pool.v_scale_caches[0].stride(0) and a["num_splits"] == 1
    assert abs(a["qk_scale"] - 0.125 * decode_int4.LOG2E) < 1e-12
    assert (a["G"], a["BLOCK_H"], a["D"], a["PAGE"], a["STAGES"]) == (3, 8, 64, 32, 2)
    assert a["SINGLE"] and a["num_warps"] == 4 and a["maxnreg"] == 128


def test_gluon_compile_failure_falls_back_to_the_triton_kernel(monkeypatch, caplog):
    """A Triton that cannot build the Gluon kernel: one warning naming its version, the call
    runs the Triton kernel (the same output as asking for it), later calls go straight there."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from kvfit.kernels import decode_int4_gluon

    monkeypatch.setattr(decode_int4_gluon, "build", Broken())
    monkeypatch.setattr(decode_int4, "_gluon_failures", [])
    q, pool, bt, lens, slots = _problem()
    want = torch.full_like(q, float("nan"))
    int4_decode(q, pool, 0, bt, lens, slots, want, 0.125, Int4DecodeConfig(2))
    got = torch.full_like(q, float("nan"))
    with caplog.at_level("WARNING", logger="kvfit"):
        int4_decode(q, pool, 0, bt, lens, slots, got, 0.125, Int4DecodeConfig(2, gluon=True))
    assert torch.equal(got, want)
    assert len(decode_int4._gluon_failures) == 1 and "does not compile" in caplog.text
    assert not decode_int4.gluon_available()


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvfit.kernels import decode_int4_gluon

d, g, stages, single = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fn = decode_int4_gluon.build()
ptrs = dict(Q="*bf16", OUT="*bf16", OP="*fp32", LSE="*fp32", KC="*u8", VC="*u8", KS="*fp16",
            KZ="*fp16", VS="*fp16", VZ="*fp16", KR="*bf16", VR="*bf16", BT="*i32",
            KVLEN="*i32", RSLOT="*i32")
consts = dict(G=g, BLOCK_H=max(8, 1 << (g - 1).bit_length()), D=d, PAGE=32, STAGES=stages,
              SINGLE=single, num_warps=4)
sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n == "qk_scale" else "i32"))
       for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or n.startswith("stride")}
k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps(dict(ptx=k.asm["ptx"], shared=k.metadata.shared)))
"""


@pytest.mark.parametrize("d,g,stages,single", [(128, 2, 2, False), (64, 3, 3, True),
                                               (256, 4, 2, False)])
def test_gluon_kernel_compiles_for_sm90(d, g, stages, single):
    """The installed Triton compiles the kernel for Hopper (in a process of its own: the CPU
    suite runs Triton's interpreter, which Gluon has not). Per 64-token tile: the logits' MMAs
    over the D channels, P . V over 64 tokens, the nibble conversion of D / 2 bytes a token of
    K and of V (one asm per four bytes, scale and zero applied: two fma.f16x2 a nibble pair),
    K's scale and zero copied with the codes (cp.async of 4 bytes or more), within 227 KB of
    shared memory."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import re

    from gluon_launch_fakes import compile_sm90

    got = compile_sm90(_COMPILE, d, g, stages, int(single))
    ptx = got["ptx"]
    n = max(8, 1 << (g - 1).bit_length())
    # a tile's logits: D / 16 k-steps; P . V: D / 64 row blocks x 4 k-steps. The residual page
    # runs the same MMAs once more.
    tile = d // 16 + (d // 64) * 4
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") == 2 * tile
    # conversions: 64 tokens x D / 2 bytes of K and of V, four bytes an asm (two prmt, four
    # lop3, two sub and six fma a asm: 2 to place the high nibbles, 4 for scale and zero)
    asms = 2 * (64 * d // 2 // 128 // 4)
    assert ptx.count("prmt.b32") == 2 * asms
    assert ptx.count("fma.rn.f16x2") == 6 * asms
    # cp.async of K's scale and zero: D / 32 halves a thread, never under 4 bytes
    sizes = {int(m, 0) for m in re.findall(
        r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (\w+)", ptx)}
    assert sizes and min(sizes) >= 4 and d // 32 * 2 in sizes, sizes
    assert got["shared"] <= 227 * 1024
