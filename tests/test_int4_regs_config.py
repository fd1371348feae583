"""The register int4 decode (``decode_int4_regs_kernel``, token-minor V pages) on the CPU: the
pool's token-minor V (the same values as token-major pages), its launch choices, the argument
binding of its launch, the fallback to the Triton kernel (which reads token-minor V too), the
per-GPU default, and its source compiled for sm_90 (nothing executes here:
tests/gpu/test_int4_decode.py proves it against the float64 reference on the GPU)."""

from __future__ import annotations

import pytest
import torch

from gluon_launch_fakes import Broken, Recording
from int4_kernel_check import decode_problem, filled_pool
from kvfit.kernels import decode_int4
from kvfit.kernels.decode_int4 import Int4DecodeConfig, choose_config, int4_decode
from kvfit.kvcache.kivi import quantize_v_tokens, v_token_major, v_token_minor


def test_token_minor_v_is_a_reordering_of_the_same_codes():
    v = torch.randn(3, 2, 32, 64, dtype=torch.float64) * 4 + 1  # [pages, H, P, D]
    packed, scale, zero = quantize_v_tokens(v)
    tm, s_tm, z_tm = v_token_minor(packed, scale, zero)
    assert tm.shape == (3, 2, 64, 16) and s_tm.shape == (3, 2, 2, 32)
    # byte i of channel c: token 2i in the low nibble, 2i + 1 in the high one
    lo_c5_t4 = packed[0, 1, 4, 2] & 15  # token 4, channels (4, 5): channel 4 is the low nibble
    assert (tm[0, 1, 4, 2] & 15) == lo_c5_t4 and (tm[0, 1, 4, 2] >> 4) == packed[0, 1, 5, 2] & 15
    assert torch.equal(s_tm[1, 0, 1, 7], scale[1, 0, 7, 1])
    back = v_token_major(tm, s_tm, z_tm)
    assert all(torch.equal(a, b) for a, b in zip(back, (packed, scale, zero)))


def test_pools_of_either_v_layout_read_back_the_same_kv():
    lens = [70, 33, 100]
    hnd, tables = filled_pool(lens, 2, 64, torch.device("cpu"), torch.bfloat16)
    hdn, tables2 = filled_pool(lens, 2, 64, torch.device("cpu"), torch.bfloat16, v_layout="HDN")
    assert tables == tables2 and hdn.v_caches[0].shape[2:] == (64, 16)
    assert hdn.v_scale_caches[0].shape[2:] == (2, 32)
    for i, n in enumerate(lens):
        pages = torch.tensor(tables[i])
        for a, b in zip(hnd.gather_kv(0, pages, n, torch.float32, i),
                        hdn.gather_kv(0, pages, n, torch.float32, i)):
            assert torch.equal(a, b)


def _problem():
    return decode_problem(v_layout="HDN")


def test_regs_launch_choices_per_head_size():
    for d, (per_sm, maxnreg, ahead) in decode_int4.REGS_TILES.items():
        cfg = choose_config(64, 8, d, 2048, 132, gluon=True, v_t=True)
        assert cfg.gluon and cfg.pages_per_tile == 2 and cfg.maxnreg == maxnreg
        assert cfg.ks_ahead == ahead
    # 64-d: 5 programs an SM in the split rule: 192 programs on 660 slots -> 3 splits
    assert choose_config(64, 3, 64, 2048, 132, gluon=True, v_t=True).num_splits == 3
    assert choose_config(64, 3, 64, 2048, 132, gluon=True).num_splits == 2
    assert not choose_config(64, 3, 64, 2048, 132).ks_ahead


def test_regs_launch_binds_every_kernel_argument(monkeypatch):
    """``int4_decode`` over a token-minor pool passes the register kernel exactly its
    parameters: the grid, the codes' page stride (the same for K and token-minor V), the
    scales' strides, and the layouts as constexprs."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from kvfit.kernels import decode_int4_regs_kernel
    from kvfit.kernels.decode_int4_regs_layouts import layouts

    real = decode_int4_regs_kernel.build()
    calls = []
    monkeypatch.setattr(decode_int4_regs_kernel, "build", Recording(real, calls))
    monkeypatch.setattr(decode_int4, "_gluon_failures", [])
    q, pool, bt, lens, slots = _problem()
    out = torch.empty_like(q)
    int4_decode(q, pool, 0, bt, lens, slots, out, 0.125,
                Int4DecodeConfig(2, maxnreg=168, gluon=True, ks_ahead=True))
    (grid, a), = calls
    assert grid == (3, 2, 2)
    assert a["VC"] is pool.v_caches[0] and a["VS"] is pool.v_scale_caches[0]
    assert a["stride_cp"] == pool.k_caches[0].stride(0) == pool.v_caches[0].stride(0)
    assert a["stride_vp"] == pool.v_scale_caches[0].stride(0) and a["num_splits"] == 2
    assert (a["G"], a["BLOCK_H"], a["D"], a["PAGE"], a["SINGLE"]) == (3, 8, 64, 32, False)
    assert a["LV4"] == layouts(64, 8)[4] and a["maxnreg"] == 168 and a["KS_AHEAD"]


def test_regs_compile_failure_falls_back_to_the_triton_kernel(monkeypatch, caplog):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from kvfit.kernels import decode_int4_regs_kernel

    monkeypatch.setattr(decode_int4_regs_kernel, "build", Broken())
    monkeypatch.setattr(decode_int4, "_gluon_failures", [])
    q, pool, bt, lens, slots = _problem()
    want = torch.full_like(q, float("nan"))
    int4_decode(q, pool, 0, bt, lens, slots, want, 0.125, Int4DecodeConfig(2))
    got = torch.full_like(q, float("nan"))
    with caplog.at_level("WARNING", logger="kvfit"):
        int4_decode(q, pool, 0, bt, lens, slots, got, 0.125, Int4DecodeConfig(2, gluon=True))
    assert torch.equal(got, want) and torch.isfinite(got).all()
    assert len(decode_int4._gluon_failures) == 1 and "does not compile" in caplog.text


def test_regs_default_per_gpu(monkeypatch):
    from kvfit.attention.triton_backend import TritonBackend

    assert decode_int4.regs_default(128, "NVIDIA H100 80GB HBM3")  # measured faster there
    assert decode_int4.regs_default(64, "NVIDIA H200")
    assert not decode_int4.regs_default(128, "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(decode_int4, "REGS_DEFAULT_ON", {"H100": frozenset({128})})
    assert not decode_int4.regs_default(64, "NVIDIA H100 80GB HBM3")
    assert not decode_int4.regs_default(128, "NVIDIA H200")
    if not torch.cuda.is_available():  # no GPU: token-major V, what every int4 kernel reads
        assert TritonBackend.v_layout("int4", 32, 128, "Int4KVCache") == "HND"


def test_folded_k_refuses_token_minor_pages():
    q, pool, bt, lens, slots = _problem()
    with pytest.raises(ValueError, match="fold_k=False"):
        int4_decode(q, pool, 0, bt, lens, slots, torch.empty_like(q), 0.125,
                    Int4DecodeConfig(1, fold_k=True))


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvfit.kernels import decode_int4_regs_kernel
from kvfit.kernels.decode_int4_regs_layouts import layouts

d, g, single = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
xmax = len(sys.argv) > 4 and sys.argv[4] == "1"
l2 = int(sys.argv[5]) if len(sys.argv) > 5 else 0
fn = decode_int4_regs_kernel.build()
ptrs = dict(Q="*bf16", OUT="*bf16", OP="*fp32", LSE="*fp32", KC="*u8", VC="*u8", KS="*fp16",
            KZ="*fp16", VS="*fp16", VZ="*fp16", KR="*bf16", VR="*bf16", BT="*i32",
            KVLEN="*i32", RSLOT="*i32")
bh = max(8, 1 << (g - 1).bit_length())
names = ("MMA", "LK", "LK4", "LKS", "LV4", "LVS", "LAK", "LAV")
consts = dict(G=g, BLOCK_H=bh, D=d, PAGE=32, SINGLE=single, KS_AHEAD=d == 256, XMAX=xmax,
              L2_AHEAD=l2,
              num_warps=4,
              **dict(zip(names, layouts(d, bh))))
sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n == "qk_scale" else "i32"))
       for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or n.startswith("stride")}
k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps(dict(ptx=k.asm["ptx"], shared=k.metadata.shared)))
"""


@pytest.mark.parametrize("d,g,single", [(128, 2, False), (64, 3, True), (256, 8, False)])
def test_regs_kernel_compiles_for_sm90(d, g, single):
    """The installed Triton compiles the kernel for Hopper, every relabelling proven free
    (``assert_trivial``). Per 64-token tile: the logits' MMAs over the D channels and P . V
    over 64 tokens with A from registers, three times (the loop, a split's one-page tile, the
    residual page); the conversion of D / 2 bytes a token of K and of V, one asm per word of
    eight codes (K: two prmt, two sub.f16x2 and six fma.f16x2; V: four of each), twice (the
    residual page loads float16 values); no shared memory but the query and P (and the
    epilogue's), no cp.async."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    got = compile_sm90(_COMPILE, d, g, int(single))
    ptx = got["ptx"]
    n = max(8, 1 << (g - 1).bit_length())
    tile = d // 16 + (d // 64) * 4
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") == 3 * tile
    words = 2 * d // 32  # a thread's K words (two rows) and V words (D/32 channels, 2 each)
    assert ptx.count("prmt.b32") == 2 * (2 * words + 4 * words)
    assert ptx.count("fma.rn.f16x2") == 2 * (6 * words + 4 * words)
    assert ptx.count("sub.f16x2") == 2 * (2 * words + 4 * words)
    assert "cp.async" not in ptx
    # the query and P, or the epilogue's float32 o^T (a 64 x D float16 operand tile: 128 D)
    assert got["shared"] <= max(2 * n * d + 2 * 64 * n, 4 * n * d) + 256


def test_regs_kernel_exchanged_maximum_takes_fewer_barriers():
    """decode_int4.EXCHANGE_MAX: the tile maximum through shared memory with one barrier that
    also stands for P.V's barrier before P's store: at least one barrier fewer in each of the
    three tile codes, the same MMAs, conversions and loads, 256 B of shared memory at most
    more."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    off, on = (compile_sm90(_COMPILE, 128, 2, 0, x) for x in (0, 1))
    bars = [c["ptx"].count("bar.sync") for c in (off, on)]
    assert bars[1] <= bars[0] - 3, bars
    for pat in ("wgmma.mma_async", "prmt.b32", "fma.rn.f16x2", "ld.global"):
        assert off["ptx"].count(pat) == on["ptx"].count(pat), pat
    assert on["shared"] <= off["shared"] + 256


@pytest.mark.parametrize("d,ahead", [(128, 2), (64, 3), (256, 2)])
def test_regs_kernel_asks_l2_for_tiles_ahead(d, ahead):
    """``Int4DecodeConfig.l2_ahead``: each thread asks L2 for its lines of the tiles ``ahead``
    tiles on (R = cdiv(5 D / 16, 64) lines a thread a tile: the codes' and scales' lines of two
    pages over 128 threads), once per tile in the loop and once for each of tiles 1 .. ahead - 1
    before it; the MMAs, conversions and shared memory are those of the kernel without it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    g = 2
    off, on = (compile_sm90(_COMPILE, d, g, 0, 1, a) for a in (0, ahead))
    r = -(-5 * d // 16 // 64)
    assert off["ptx"].count("prefetch.global.L2") == 0
    assert on["ptx"].count("prefetch.global.L2") == r * ahead
    # (the conversions' asm by its own register names: LLVM may use prmt for indices too)
    for pat in ("wgmma.mma_async", "prmt.b32 a,", "prmt.b32 b,", "prmt.b32 t,", "fma.rn.f16x2",
                "sub.f16x2", "bar.sync"):
        assert off["ptx"].count(pat) == on["ptx"].count(pat), pat
    assert on["shared"] == off["shared"]
