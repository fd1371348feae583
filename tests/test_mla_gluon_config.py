"""The Gluon MLA decode kernel's choices on the CPU: ``decode_config(gluon=True)`` (tile,
stages, splits by the wave rule), the shapes and stage counts it refuses with a clear error,
the default off where no Hopper GPU runs; and the kernel's source compiled for sm_90 by the
installed Triton (nothing executes: the GPU tests in tests/gpu/test_mla_decode_gluon.py prove
it against the float64 reference)."""

from __future__ import annotations

import pytest
import torch

from kvfit.kernels import mla, mla_gluon
from kvfit.kernels.mla import decode_config
from kvfit.kernels.mla_gluon import gluon_fits

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def test_gluon_config_register_kernel_for_8_bit_latents():
    # the register-operand kernel: the default for both 8-bit formats (measured faster than
    # the shared-memory kernels since the twenty-third session), regs=True asks for it; two
    # programs an SM for the splits
    assert set(mla.GLUON_REGS) == {E4M3, torch.float8_e5m2}
    for fmt, kw in ((E4M3, {}), (E4M3, dict(regs=True)), (torch.float8_e5m2, {})):
        cfg = decode_config(4, 16, 512, 32768, fmt, BF16, gluon=True, **kw)
        assert cfg.regs and cfg.gluon and not cfg.pipe and not cfg.qfp8
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (16, 64, 4)
        assert cfg.num_splits == 64  # 4 programs x 64 splits: 256 = 2 per SM (1% a split)
    assert decode_config(32, 16, 512, 16384, E4M3, BF16, gluon=True, regs=True).num_splits == 8
    assert decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, regs=True,
                         programs_per_sm=1).num_splits == 33
    # any choice that names another kernel's knob keeps the shared-memory kernels
    e5 = torch.float8_e5m2
    for kw in (dict(regs=False), dict(num_stages=3), dict(qfp8=False), dict(conv_vec=16)):
        assert not decode_config(4, 16, 512, 32768, e5, BF16, gluon=True, **kw).regs
    for kw in (dict(regs=False), dict(pipe=True), dict(num_stages=3), dict(qfp8=True)):
        assert not decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, **kw).regs
    assert not decode_config(4, 16, 512, 32768, BF16, BF16, gluon=True, regs=True).regs
    assert "registers" in mla.describe_decode(
        decode_config(4, 16, 512, 32768, e5, BF16, gluon=True), e5)


def test_gluon_config_tiles_stages_and_splits():
    cfg = decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, regs=False)
    # e4m3 without the register kernel: the pipelined kernel (fp8 logits, 2 stages)
    assert cfg.gluon and cfg.pipe == mla.GLUON_PIPE and cfg.qfp8 == mla.GLUON_PIPE
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (16, 64, 4)
    assert cfg.num_stages == (2 if mla.GLUON_PIPE else 3)
    assert cfg.num_splits == 33  # 4 programs: 33 splits fill 132 SMs once (1% per split)
    # asking for 3 stages or plain logits keeps the plain Gluon kernel
    plain = decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, num_stages=3)
    assert not plain.pipe and plain.num_stages == 3 and not plain.qfp8
    assert not decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, qfp8=False).pipe
    e5 = decode_config(4, 16, 512, 32768, torch.float8_e5m2, BF16, gluon=True, regs=False)
    assert not e5.pipe and not e5.qfp8 and e5.num_stages == 3
    cfg16 = decode_config(32, 16, 512, 16384, BF16, BF16, gluon=True)
    assert cfg16.num_stages == 2 and cfg16.num_splits == 4
    # V2's 128 heads: eight programs of 16 heads a request, the splits count them
    v2 = decode_config(16, 128, 512, 16384, E4M3, BF16, gluon=True, regs=False)
    assert v2.num_splits == 1
    assert decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, num_splits=5).num_splits == 5
    # the pipelined kernel: e4m3 only, fp8 logits, 2 stages
    pc = decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, pipe=True)
    assert pc.pipe and pc.qfp8 and pc.num_stages == 2
    assert not decode_config(4, 16, 512, 32768, BF16, BF16, gluon=True, pipe=True).pipe
    assert decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True,
                         regs=False).conv_vec == 8  # measured
    assert decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, conv_vec=16).conv_vec == 16
    with pytest.raises(ValueError, match="8 or 16"):
        decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, conv_vec=4)
    with pytest.raises(ValueError, match="2 stages"):
        decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, pipe=True, num_stages=3)
    # fp8 logits: e4m3 latents only
    assert decode_config(4, 16, 512, 32768, E4M3, BF16, gluon=True, qfp8=True).qfp8
    assert not decode_config(4, 16, 512, 32768, torch.float8_e5m2, BF16, gluon=True,
                             qfp8=True).qfp8
    assert not decode_config(4, 16, 512, 32768, BF16, BF16, gluon=True, qfp8=True).qfp8


@pytest.mark.parametrize("kw,match", [
    (dict(rank=48), "512 \\+ 64"), (dict(rope=32), "512 \\+ 64"),
    (dict(q_dtype=torch.float32), "16-bit queries"), (dict(cache_dtype=torch.float32), "512"),
    (dict(num_stages=4), "2..3 stages"), (dict(cache_dtype=BF16, num_stages=3), "2..2 stages"),
    (dict(num_stages=1), "2..3 stages")])
def test_gluon_config_refusals_name_the_problem(kw, match):
    args = dict(batch=4, num_heads=16, rank=512, max_kv_len=4096, cache_dtype=E4M3,
                q_dtype=BF16)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        decode_config(**args, gluon=True)


def test_gluon_default_off_without_hopper():
    assert gluon_fits(512, 64, E4M3, BF16) and gluon_fits(512, 64, BF16, torch.float16)
    assert not gluon_fits(512, 64, torch.float32, BF16) and not gluon_fits(256, 64, BF16, BF16)
    if not torch.cuda.is_available():
        assert not mla_gluon.gluon_available(0) and not mla_gluon.usable(0)
        assert not decode_config(4, 16, 512, 32768, E4M3, BF16).gluon
    # an explicit kernel choice keeps the Triton kernels
    assert not decode_config(4, 16, 512, 32768, BF16, BF16, swap=True).gluon


# the end of both compile scripts: the kernel's signature, specialised as the JIT does, compiled
# for sm_90; prints the PTX and the shared memory as one JSON line
_COMPILE_TAIL = """
sig = dict(Q="*bf16", C="*" + cdt, BT="*i32", KVLEN="*i32", OUT="*bf16", OP="*fp32",
           LSE="*fp32", qk_scale="fp32", out_scale="fp32", stride_qt="i32", stride_qh="i32",
           stride_ot="i32", stride_oh="i32", stride_cp="i32", stride_bt="i32", num_splits="i32")
sig.update({k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or n.startswith("stride")}
k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps(dict(ptx=k.asm["ptx"], shared=k.metadata.shared)))
"""

_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvfit.kernels import mla_decode_gluon

cdt, stages, single, qfp8 = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
pipe = stages == 0  # the pipelined e4m3 kernel (mla_decode_fp8_pipe)
if pipe:
    from kvfit.kernels import mla_decode_fp8_pipe
    fn = mla_decode_fp8_pipe.build()
else:
    fn = mla_decode_gluon.build()
xv = int(sys.argv[5])
consts = dict(H=16, RANK=512, ROPE=64, SLAB=576, PAGE=32, BLOCK_H=16, BLOCK_N=64, HBLK=1,
              CHUNK=16, SINGLE=single, XV=xv, num_warps=4)
if not pipe:
    consts.update(STAGES=stages, CONVERT=cdt.startswith("fp8"), QFP8=qfp8)
""" + _COMPILE_TAIL


@pytest.mark.parametrize("cdt,stages,single,qfp8,xv", [
    ("fp8e4nv", 3, False, False, 16), ("bf16", 2, True, False, 16),
    ("fp8e4nv", 3, True, True, 8), ("fp8e4nv", 0, False, True, 16), ("fp8e4nv", 0, True, True, 8)])
def test_gluon_kernel_compiles_for_sm90(cdt, stages, single, qfp8, xv):
    """The installed Triton compiles the kernel for Hopper (in a process of its own: the CPU
    suite runs Triton's interpreter, which Gluon has not): 68 warp-group MMAs of m64n16k16 per
    tile (36 for the logits over 512 + 64 columns, 32 for P . latent), and for 8-bit latents
    one packed conversion per two latent values of the tile, in at most 227 KB of shared
    memory. With fp8 logits (``qfp8``): 36 fp8 MMAs m64n16k32 (the query's two e4m3 parts
    over 512 + 64 columns) and the conversion of the 512 latent columns only; the pipelined
    kernel (``stages`` 0 here) has the prologue's tile-0 logits as well (72)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    got = compile_sm90(_COMPILE, cdt, stages, int(single), int(qfp8), xv)
    ptx = got["ptx"]
    mma = "m64n16k16.f32.f16.f16" if cdt.startswith("fp8") else "m64n16k16.f32.bf16.bf16"
    if qfp8:
        assert ptx.count("wgmma.mma_async.sync.aligned." + mma) == 32
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3") == \
            (72 if stages == 0 else 36)
        # the loop's 512 columns (64 x 512 / 128 threads / 2 a cvt), the query's parts more
        assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 64 * 512 // 128 // 2
    else:
        assert ptx.count("wgmma.mma_async.sync.aligned." + mma) == 68
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == \
            (64 * 576 // 128 // 2 if cdt == "fp8e4nv" else 0)
    assert got["shared"] <= 227 * 1024


@pytest.mark.parametrize("pipe,fmt", [(False, torch.float8_e4m3fn), (True, torch.float8_e4m3fn),
                                      (False, torch.bfloat16)])
def test_gluon_launch_binds_every_kernel_argument(monkeypatch, pipe, fmt):
    """``mla_gluon.launch`` passes each kernel exactly its parameters (bound against the jitted
    function's signature, nothing executes): the grid (requests x head blocks, splits), the
    scales, the strides, and the constexprs of the plain or the pipelined kernel."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import Recording

    from kvfit.kernels import mla_decode_fp8_pipe, mla_decode_gluon

    real = (mla_decode_fp8_pipe if pipe else mla_decode_gluon).build()
    calls = []
    monkeypatch.setattr(mla_decode_fp8_pipe if pipe else mla_decode_gluon, "build",
                        Recording(real, calls))
    b, h, pages = 3, 20, 9
    q = torch.randn(b, h, 576, dtype=BF16)
    cache = torch.zeros(pages, 32, 576, dtype=fmt)
    table = torch.zeros(b, 4, dtype=torch.int32)
    lens = torch.tensor([5, 70, 100], dtype=torch.int32)
    out = torch.empty(b, h, 512, dtype=BF16)
    cfg = decode_config(b, h, 512, 100, fmt, BF16, gluon=True, pipe=pipe, num_splits=2,
                        qfp8=None if pipe else False)
    op, lse = torch.empty(b * h * 2, 512), torch.empty(b * h * 2)
    assert mla_gluon.launch(q, cache, table, lens, out, op, lse, 512, 0.25, 0.5, cfg)
    (grid, a), = calls
    assert grid == (b * 2, 2)  # 20 heads: two programs of 16 per request
    assert a["OP"] is op and a["LSE"] is lse and a["qk_scale"] == 0.25 and a["out_scale"] == 0.5
    assert (a["H"], a["RANK"], a["ROPE"], a["SLAB"], a["PAGE"], a["HBLK"]) == (h, 512, 64, 576,
                                                                                32, 2)
    assert a["stride_cp"] == 32 * 576 and a["stride_bt"] == 4 and a["num_splits"] == 2
    assert not a["SINGLE"] and a["num_warps"] == 4 and a["XV"] == 8
    if not pipe:
        assert a["CONVERT"] == (fmt != BF16) and a["STAGES"] == cfg.num_stages and not a["QFP8"]


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_regs_launch_binds_every_kernel_argument(monkeypatch, fmt):
    """The register-operand kernel's launch: every parameter bound, its layouts and the
    conversion asm of the latent format; its refusal of 16-bit latents names the fix."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import Recording

    from kvfit.kernels import mla_decode_fp8_regs

    calls = []
    monkeypatch.setattr(mla_decode_fp8_regs, "build",
                        Recording(mla_decode_fp8_regs.build(), calls))
    b, h = 3, 20
    q = torch.randn(b, h, 576, dtype=BF16)
    cache = torch.zeros(9, 16, 576, dtype=fmt)
    table = torch.zeros(b, 7, dtype=torch.int32)
    lens = torch.tensor([5, 70, 100], dtype=torch.int32)
    out = torch.empty(b, h, 512, dtype=BF16)
    cfg = decode_config(b, h, 512, 100, fmt, BF16, gluon=True, regs=True, num_splits=1)
    assert mla_gluon.launch(q, cache, table, lens, out, out, out, 512, 0.25, 0.5, cfg)
    (grid, a), = calls
    assert grid == (b * 2, 1) and a["SINGLE"] and a["OUT"] is out
    assert (a["H"], a["PAGE"], a["HBLK"], a["BLOCK_H"], a["num_warps"]) == (h, 16, 2, 16, 4)
    assert (a["MMA"], a["LW"], a["LA"]) == mla_decode_fp8_regs.layouts(16)
    name = "e4m3" if fmt == torch.float8_e4m3fn else "e5m2"
    assert a["ASM"] == mla_decode_fp8_regs.WORD_ASM[name] and f".{name}x2" in a["ASM"]
    with pytest.raises(ValueError, match="regs=False"):
        mla_gluon.launch(q, cache.to(BF16), table, lens, out, out, out, 512, 0.25, 0.5, cfg)


_COMPILE_REGS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvfit.kernels import mla_decode_fp8_regs

cdt, single = sys.argv[1], sys.argv[2] == "1"
l2 = int(sys.argv[3]) if len(sys.argv) > 3 else 0
fn = mla_decode_fp8_regs.build()
mma, lw, la = mla_decode_fp8_regs.layouts(16)
consts = dict(H=16, RANK=512, ROPE=64, SLAB=576, PAGE=32, BLOCK_H=16, BLOCK_N=64, HBLK=1,
              SINGLE=single, MMA=mma, LW=lw, LA=la, num_warps=4, L2_AHEAD=l2,
              ASM=mla_decode_fp8_regs.WORD_ASM["e4m3" if cdt == "fp8e4nv" else "e5m2"])
""" + _COMPILE_TAIL


@pytest.mark.parametrize("cdt,single", [("fp8e4nv", False), ("fp8e5", True)])
def test_regs_kernel_compiles_for_sm90(cdt, single):
    """The register-operand kernel compiles for Hopper, its relabelling proven free
    (``assert_trivial``): per 64-token tile 36 m64n16k16 MMAs with A from registers for the
    logits and 32 from shared memory for P . latent; a thread's two rows of the tile loaded as
    nine 16-byte vectors each (twice: the prologue's tile 0 and the loop's next tile) and
    converted by one hardware cvt per two latents (64 x 576 / 128 threads / 2); the query
    block (16 heads x 576 16-bit values) in nine 16-byte vectors a thread, not element by
    element; no cp.async; 84 KB of shared memory at most, so two programs fit on an SM."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    got = compile_sm90(_COMPILE_REGS, cdt, int(single))
    ptx = got["ptx"]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16") == 68
    fmt = "e4m3" if cdt == "fp8e4nv" else "e5m2"
    assert ptx.count(f"cvt.rn.f16x2.{fmt}x2") == 64 * 576 // 128 // 2
    assert ptx.count("ld.global.v4.b32") == 2 * 2 * 9 + 16 * 576 * 2 // 128 // 16
    assert "ld.global.b16" not in ptx and "ld.global.u16" not in ptx
    assert "cp.async" not in ptx
    assert got["shared"] <= 86 * 1024


@pytest.mark.parametrize("ahead", [2, 3])
def test_regs_kernel_asks_l2_for_tiles_ahead(ahead):
    """``MLAConfig.l2_ahead``: each thread asks L2 for four lines of its token's slab (two
    threads a token cover the 576 bytes' five lines and its last byte) of tile i + ahead in
    tile i, and of tiles 1 .. ahead - 1 before the loop; the MMAs, conversions, loads of the
    tiles and shared memory are those of the kernel without it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    off, on = (compile_sm90(_COMPILE_REGS, "fp8e4nv", 0, a) for a in (0, ahead))
    assert off["ptx"].count("prefetch.global.L2") == 0
    assert on["ptx"].count("prefetch.global.L2") == 4 * ahead
    for pat in ("wgmma.mma_async", "cvt.rn.f16x2.e4m3x2", "ld.global.v4.b32", "bar.sync"):
        assert off["ptx"].count(pat) == on["ptx"].count(pat), pat
    assert on["shared"] == off["shared"]


def test_regs_ablation_rewrites_still_apply(tmp_path):
    """benchmarks/kernels/mla_regs_ablation.py takes the register kernel apart (and builds its
    mma.sync candidate) by rewriting its source: every rewrite must still find its line in the
    kernel as shipped."""
    from bench_scripts import kernel_script

    mod = kernel_script("mla_regs_ablation")
    names = mod.VARIANTS
    assert {"full", "tile-sum", "rows-in-tile", "mma-sync"} <= set(names)
    for v in names:
        build, layouts = mod.variant_build(v, str(tmp_path))
        assert callable(build) and callable(layouts)
        # the launch takes the layouts from the module: the mma.sync candidate must bring its own
        assert list(layouts(16)[0].version) == ([2, 0] if v == "mma-sync" else [3, 0])
    assert len(list(tmp_path.iterdir())) == len(names) - 1
