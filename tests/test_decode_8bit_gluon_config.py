"""The Gluon 8-bit decode on the CPU: its launch choices (``choose_config(gluon=True)``), the
pages and queries it refuses with a clear error, the argument binding of its launch, the
fallback to the Triton kernel when the installed Triton cannot compile it, the triton
backend's default, and its source compiled for sm_90 (nothing executes here:
tests/gpu/test_decode_8bit_gluon.py proves it against the reference on the GPU)."""

from __future__ import annotations

import pytest
import torch

from gluon_launch_fakes import Broken, Recording
from kvfit.kernels import decode, decode_8bit_gluon
from kvfit.kernels.decode import choose_config, paged_decode


def test_gluon_launch_choices_per_head_size():
    for d, (per_sm, maxnreg) in decode_8bit_gluon.GLUON_TILES.items():
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
            cfg = choose_config(64, 8, 2, d, 2048, dt, torch.bfloat16, v_t=True, gluon=True)
            assert cfg.gluon and cfg.block_n == 64 and cfg.heads == 1 and cfg.pack == 1
            assert (cfg.num_stages, cfg.maxnreg) == (1, maxnreg)
            assert not cfg.fused_merge and cfg.min_split_tokens == 0
            # its tiles are 64 tokens: another block_n is refused naming the fix
            with pytest.raises(ValueError, match="leave block_n unset"):
                choose_config(64, 8, 2, d, 2048, dt, torch.bfloat16, v_t=True, gluon=True,
                              block_n=128)
    assert not choose_config(64, 8, 2, 128, 2048, torch.int8, torch.bfloat16, v_t=True).gluon


@pytest.mark.parametrize("cache,q,v_t", [(torch.bfloat16, torch.bfloat16, False),
                                         (torch.float8_e4m3fn, torch.bfloat16, False),
                                         (torch.int8, torch.float32, True)])
def test_gluon_choice_refuses_what_it_cannot_read(cache, q, v_t):
    with pytest.raises(ValueError, match="gluon=False"):
        choose_config(4, 8, 2, 128, 2048, cache, q, v_t=v_t, gluon=True)


def test_fits_names_each_reason():
    f = decode_8bit_gluon.fits
    e4 = torch.float8_e4m3fn
    assert f(e4, torch.bfloat16, 128, 32, True) is None
    assert f(torch.int8, torch.float16, 64, 16, True) is None
    assert "bfloat16 pages" in f(torch.bfloat16, torch.bfloat16, 128, 32, True)
    assert "float32 queries" in f(e4, torch.float32, 128, 32, True)
    assert "head_dim 96" in f(e4, torch.bfloat16, 96, 32, True)
    assert "pages of 8" in f(e4, torch.bfloat16, 128, 8, True)
    assert "token-minor" in f(e4, torch.bfloat16, 128, 32, False)
    assert "soft-cap" in f(e4, torch.bfloat16, 128, 32, True, softcap=30.0)
    assert "window" in f(e4, torch.bfloat16, 128, 32, True, window=512)


def _problem(dtype=torch.int8, lens=(70, 33, 100), page=32, hkv=2, g=3, d=64):
    torch.manual_seed(0)
    b = len(lens)
    pages = sum(-(-n // page) for n in lens) + 2
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, (pages, hkv, page, d), dtype=torch.int8)
        vc = torch.randint(-127, 128, (pages, hkv, d, page), dtype=torch.int8)
        scales = dict(k_scale_cache=torch.rand(pages, hkv, page, dtype=torch.float16) / 50,
                      v_scale_cache=torch.rand(pages, hkv, page, dtype=torch.float16) / 50)
    else:
        kc = torch.randn(pages, hkv, page, d).to(dtype)
        vc = torch.randn(pages, hkv, d, page).to(dtype)
        scales = dict(k_scale=0.5, v_scale=2.0)
    perm = torch.randperm(pages)
    bt = torch.zeros(b, max(-(-n // page) for n in lens), dtype=torch.int32)
    i = 0
    for r, n in enumerate(lens):
        k = -(-n // page)
        bt[r, :k] = perm[i:i + k]
        i += k
    q = torch.randn(b, hkv * g, d, dtype=torch.bfloat16)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), scales


def test_gluon_launch_binds_every_kernel_argument(monkeypatch):
    """``paged_decode`` passes the Gluon kernel exactly its parameters (bound against the jitted
    function's signature): the grid (requests, KV heads, splits), the page and scale strides,
    the base-2 softmax scale and the constexprs."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    real = decode_8bit_gluon.build()
    calls = []
    monkeypatch.setattr(decode_8bit_gluon, "build", Recording(real, calls))
    monkeypatch.setattr(decode_8bit_gluon, "_failures", [])
    for dtype in (torch.int8, torch.float8_e5m2):
        calls.clear()
        q, kc, vc, bt, lens, sc = _problem(dtype)
        out = torch.empty_like(q)
        cfg = decode.DecodeConfig(1, 64, True, 4, 3, 128, v_t=True, gluon=True)
        paged_decode(q, kc, vc, bt, lens, out, 0.125, cfg, **sc)
        (grid, a), = calls
        assert grid == (3, 2, 1)
        assert a["Q"] is q and a["OUT"] is out and a["KC"] is kc and a["VC"] is vc
        assert a["stride_cp"] == kc.stride(0) == 2 * 32 * 64 and a["stride_ch"] == 32 * 64
        assert a["num_splits"] == 1 and a["KVLEN"] is lens and a["BT"] is bt
        int8 = dtype == torch.int8
        if int8:
            assert a["KS"] is sc["k_scale_cache"] and a["VS"] is sc["v_scale_cache"]
            assert (a["stride_sp"], a["stride_sh"]) == (2 * 32, 32)
        want = 0.125 * decode.LOG2E * (1.0 if int8 else 0.5)
        assert abs(a["qk_scale"] - want) < 1e-12
        assert a["v_out"] == (1.0 if int8 else 2.0)
        assert (a["G"], a["BLOCK_H"], a["D"], a["PAGE"]) == (3, 8, 64, 32)
        assert a["CODE"] == (2 if int8 else 1) and a["SINGLE"] and a["num_warps"] == 4
        assert a["maxnreg"] == 128
        mma, lk, lv, lak, lav = decode_8bit_gluon.operand_layouts(64, 32, 8)
        mma_i = mma
        if int8:  # int8 keys: s8 MMAs over K as loaded
            mma_i, lk, lak = decode_8bit_gluon.int8_key_layouts(64, 8)
        assert (a["MMA"], a["MMA_I"], a["LK"], a["LV"], a["LAK"], a["LAV"]) == (
            mma, mma_i, lk, lv, lak, lav)


def test_gluon_refuses_scale_caches_past_32_bit_offsets():
    """The kernel indexes int8 scale caches with 32-bit offsets: caches of 2^31 elements or
    more are refused naming the fix (expanded views: no memory)."""
    q, kc, vc, bt, lens, _ = _problem(torch.int8)
    huge = torch.ones(1, 1, 1, dtype=torch.float16).expand(2 ** 26, 2, 2 ** 4)
    assert huge.numel() == 2 ** 31
    with pytest.raises(ValueError, match="32-bit offsets.*gluon=False"):
        decode_8bit_gluon.launch_args(q, kc, vc, bt, lens, torch.empty_like(q), None, None,
                                      0.1, 1.0, 1, scale_caches=(huge, huge))


def test_gluon_refuses_a_window_naming_the_fix():
    q, kc, vc, bt, lens, sc = _problem(torch.float8_e4m3fn)
    cfg = decode.DecodeConfig(1, 64, True, 4, 3, v_t=True, gluon=True)
    with pytest.raises(ValueError, match="gluon=False"):
        paged_decode(q, kc, vc, bt, lens, torch.empty_like(q), 0.125, cfg, window=40, **sc)


def test_gluon_compile_failure_falls_back_to_the_triton_kernel(monkeypatch, caplog):
    """A Triton that cannot build the Gluon kernel: one warning naming its version, the call
    runs the Triton kernel (the same output as asking for it), and ``available`` turns off."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

    monkeypatch.setattr(decode_8bit_gluon, "build", Broken())
    monkeypatch.setattr(decode_8bit_gluon, "_failures", [])
    q, kc, vc, bt, lens, sc = _problem(torch.int8, lens=(40, 9))
    cfg = decode.DecodeConfig(2, 64, True, 4, 3, v_t=True, gluon=True)
    want = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, want, 0.125, decode.DecodeConfig(2, 64, True, 4, 3,
                                                                       v_t=True), **sc)
    got = torch.full_like(q, float("nan"))
    with caplog.at_level("WARNING", logger="kvfit"):
        paged_decode(q, kc, vc, bt, lens, got, 0.125, cfg, **sc)
    assert torch.equal(got, want) and not got.isnan().any()
    assert len(decode_8bit_gluon._failures) == 1 and "does not compile" in caplog.text
    assert not decode_8bit_gluon.available()


def test_default_on_is_per_gpu_name():
    on = decode_8bit_gluon.default_on
    assert on("fp8", 128, "NVIDIA H100 80GB HBM3") and on("int8", 256, "NVIDIA H100 PCIe")
    assert on("int8", 64, "NVIDIA H100 80GB HBM3")  # s8 keys, 80 registers: faster there
    assert not on("int8", 96, "NVIDIA H100 80GB HBM3")  # a pair not listed
    assert on("fp8", 128, "NVIDIA H200") and on("int8", 64, "NVIDIA H200")  # measured there
    assert not on("fp8", 128, "NVIDIA A100-SXM4-80GB")  # not Hopper: not listed
    assert not on(None, 128, "NVIDIA H100 80GB HBM3")


def test_backend_default_follows_default_on(monkeypatch):
    """The triton backend asks for the kernel only for the (format, head size) pairs that
    ``DEFAULT_ON`` lists for a Hopper GPU: never on the CPU."""
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kvcache.dtypes import kv_format
    from kvfit.kvcache.pool import MHAKVCache
    from kvfit.kvcache.spec import KVLayerSpec

    monkeypatch.setattr(decode_8bit_gluon, "DEFAULT_ON", {"": frozenset({("fp8", 128)})})
    pool = MHAKVCache([KVLayerSpec("full", 8, 128, None)], 8, 32, kv_format("fp8_e4m3"),
                      torch.device("cpu"), v_layout="HDN")
    be = TritonBackend(pool, torch.bfloat16, 128 ** -0.5)
    be.num_q_heads = 16
    assert not be._gluon_decode()  # no Hopper GPU here
    assert not be._decode_config(4, 4096).gluon
    # a pool that names its device by a string (as the interpreter checks build one)
    pool = MHAKVCache([KVLayerSpec("full", 8, 128, None)], 8, 32, kv_format("int8"), "cpu",
                      v_layout="HDN")
    be = TritonBackend(pool, torch.bfloat16, 128 ** -0.5)
    assert not be._gluon_decode() and not be._decode_config(4, 4096).gluon


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvfit.kernels import decode_8bit_gluon

d, g, page, kdt, single = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                           sys.argv[5] == "1")
xmax = len(sys.argv) > 6 and sys.argv[6] == "1"
l2 = int(sys.argv[7]) if len(sys.argv) > 7 else 0
fn = decode_8bit_gluon.build()
ptrs = dict(Q="*bf16", OUT="*bf16", OP="*fp32", LSE="*fp32", KC="*" + kdt, VC="*" + kdt,
            KS="*fp16", VS="*fp16", BT="*i32", KVLEN="*i32")
bh = max(8, 1 << (g - 1).bit_length())
mma, lk, lv, lak, lav = decode_8bit_gluon.operand_layouts(d, page, bh)
mma_i = mma
if kdt == "i8":
    mma_i, lk, lak = decode_8bit_gluon.int8_key_layouts(d, bh)
consts = dict(G=g, BLOCK_H=bh, D=d, PAGE=page,
              CODE={"fp8e4nv": 0, "fp8e5": 1, "i8": 2}[kdt], SINGLE=single, MMA=mma,
              MMA_I=mma_i, LK=lk, LV=lv, LAK=lak, LAV=lav, XMAX=xmax, L2_AHEAD=l2,
              num_warps=4)
sig = {n: ptrs.get(n, "constexpr" if n in consts else
                   ("fp32" if n in ("qk_scale", "v_out") else "i32")) for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or n.startswith("stride")}
k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps(dict(ptx=k.asm["ptx"], shared=k.metadata.shared)))
"""


@pytest.mark.parametrize("d,g,page,kdt,single", [
    (128, 2, 32, "fp8e4nv", False), (128, 4, 16, "i8", True), (64, 3, 16, "fp8e5", False),
    (64, 3, 64, "i8", False), (256, 2, 32, "fp8e4nv", True), (256, 2, 16, "i8", False)])
def test_gluon_kernel_compiles_for_sm90(d, g, page, kdt, single):
    """The installed Triton compiles the kernel for Hopper (in a process of its own: the CPU
    suite runs Triton's interpreter, which Gluon has not). The tile code twice (the loop's
    unmasked tile and the split's last, masked one), each: the logits' MMAs over the D
    channels (int8: s8 MMAs, twice, for the query's two terms) and P . V over the tile's
    tokens with A operands from registers; the tile's codes converted once (fp8 e4m3: one
    packed cvt per two values of K and V; int8: V's only, two prmt per four, K's codes are the
    s8 operand as loaded); the codes loaded as 16-byte vectors; the operands' relabelling
    moves no data (no shared memory beyond the query and P)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    got = compile_sm90(_COMPILE, d, g, page, kdt, int(single))
    tok = 64  # a tile's tokens
    ptx = got["ptx"]
    n = max(8, 1 << (g - 1).bit_length())
    pv = (d // 64) * (tok // 16)  # P . V's m64 k16 MMAs a tile
    logits = (tok // 64) * (d // 16)
    f16 = ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16")
    s8 = ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k32.s32.s8.s8")
    if kdt == "i8":
        assert (f16, s8) == (2 * pv, 2 * 2 * (tok // 64) * (d // 32))
    else:
        assert (f16, s8) == (2 * (pv + logits), 0)
    codes = tok * d // 128  # K's (or V's) codes of a tile, a thread's share
    if kdt == "fp8e4nv":
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * (2 * codes // 2)
    if kdt == "i8":
        assert ptx.count("0x64646464") == 2 * (codes // 4 * 2)  # V's words, two prmt each
    # K's 16-byte vectors: D / 16 bytes... per row; V's one per channel row and page slice
    assert "ld.global.v4.b32" in ptx
    # the query [BLOCK_H, D] (two int8 terms for int8) and P [T, BLOCK_H] in float16 (or the
    # epilogue's float32 [D, BLOCK_H] layout change): the only shared memory
    assert got["shared"] <= max(2 * (n * d + tok * n), 4 * d * n) + 1024, got["shared"]


@pytest.mark.parametrize("d,g,page,kdt", [(128, 2, 32, "fp8e4nv"), (64, 3, 16, "i8")])
def test_gluon_kernel_exchanged_maximum_takes_fewer_barriers(d, g, page, kdt):
    """EXCHANGE_MAX: the tile maximum through shared memory with one barrier, which also
    stands for P.V's barrier before P's store: at least one barrier fewer in each of the two
    tile codes (the loop's and the masked last tile's; the PTX of the default already shares
    one between Gluon's reduction and P.V's; ptxas: 14 -> 9 BAR.SYNC at 128-d), the same MMAs,
    conversions and loads, 256 B of shared memory at most more."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    off, on = (compile_sm90(_COMPILE, d, g, page, kdt, 0, x) for x in (0, 1))
    bars = [c["ptx"].count("bar.sync") for c in (off, on)]
    assert bars[1] <= bars[0] - 2, bars
    for pat in ("wgmma.mma_async", "cvt.rn.f16x2", "ld.global.v4.b32"):
        assert off["ptx"].count(pat) == on["ptx"].count(pat), pat
    assert on["shared"] <= off["shared"] + 256


@pytest.mark.parametrize("d,g,page,kdt", [(128, 2, 32, "fp8e4nv"), (64, 3, 16, "i8"),
                                          (256, 8, 32, "fp8e5")])
def test_gluon_kernel_asks_l2_for_tiles_ahead(d, g, page, kdt):
    """``L2_AHEAD``: each thread asks L2 for R = max(1, D / 128) lines of the codes of tile
    i + 2 in tile i and of tile 1 before the loop (int8: R lines of scales too); the MMAs,
    conversions, tile loads, barriers and shared memory are those of the kernel without it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from gluon_launch_fakes import compile_sm90

    off, on = (compile_sm90(_COMPILE, d, g, page, kdt, 0, 1, a) for a in (0, 2))
    r = max(1, d // 128) * (2 if kdt == "i8" else 1)
    assert off["ptx"].count("prefetch.global.L2") == 0
    assert on["ptx"].count("prefetch.global.L2") == 2 * r
    for pat in ("wgmma.mma_async", "cvt.rn.f16x2", "ld.global.v4.b32", "bar.sync"):
        assert off["ptx"].count(pat) == on["ptx"].count(pat), pat
    assert on["shared"] == off["shared"]
