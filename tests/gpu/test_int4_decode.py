"""The int4 Triton decode kernel on the GPU against the float64 reference over the same int4
pages and residual: head_dim 64/128/256, GQA groups 3/2/8, 1-4 splits, 2 and 4 pages per tile,
the asm and the cast nibble conversion, K's scale folded into the query (bf16 queries and
residual), the exact float32 path, and the Gluon kernel (Hopper: decode_int4_gluon);
lengths ending mid-page, on a page boundary and inside the first page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from int4_kernel_check import run_check  # noqa: E402

pytestmark = pytest.mark.gpu
LENS = [1000, 512, 7, 33, 2049, 64]


@pytest.mark.parametrize("hq,hkv,d,splits,npg,asm", [
    (9, 3, 64, 1, 2, True), (9, 3, 64, 4, 4, True), (16, 8, 128, 1, 4, True),
    (16, 8, 128, 4, 2, True), (16, 8, 128, 4, 2, False), (8, 1, 256, 1, 2, True),
    (8, 1, 256, 3, 2, True)])
def test_int4_decode_matches_reference(hq, hkv, d, splits, npg, asm):
    err = run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3,
                    num_splits=splits, pages_per_tile=npg, asm=asm,
                    num_warps=8 if d * npg >= 512 else 4, num_stages=2 if d >= 256 else 3)
    print(f"hq={hq} hkv={hkv} d={d} splits={splits} npg={npg} asm={asm}: rel error {err:.2e}")


@pytest.mark.parametrize("hq,hkv,d,splits", [(9, 3, 64, 1), (16, 8, 128, 4), (8, 1, 256, 2)])
def test_int4_decode_folded_k_matches_reference(hq, hkv, d, splits):
    err = run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3,
                    num_splits=splits, num_stages=4, fold_k=True)
    print(f"fold_k hq={hq} hkv={hkv} d={d} splits={splits}: rel error {err:.2e}")


@pytest.mark.parametrize("hq,hkv,d,stages", [(9, 3, 64, 3), (16, 8, 128, 1), (8, 1, 256, 2)])
def test_int4_decode_per_token_k_scales_match_reference(hq, hkv, d, stages):
    err = run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3, num_splits=3,
                    num_stages=stages, num_warps=8 if d >= 256 else 4, ks_tokens=True)
    print(f"ks_tokens hq={hq} hkv={hkv} d={d}: rel error {err:.2e}")


def test_int4_decode_float32_is_exact():
    err = run_check(torch.device("cuda"), torch.float32, LENS, 16, 8, 128, 1e-5, num_splits=2,
                    pages_per_tile=2)
    print(f"float32: relative error {err:.2e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,splits,stages", [
    (9, 3, 64, 1, 2), (9, 3, 64, 4, 3), (16, 8, 128, 1, 2), (16, 8, 128, 3, 3),
    (16, 8, 128, 5, 2), (32, 2, 128, 2, 2), (8, 1, 256, 2, 2), (8, 4, 256, 1, 3)])
def test_int4_decode_gluon_matches_reference(hq, hkv, d, splits, stages, dtype):
    """The Gluon kernel (two pages a tile, K dequantized with its page's scale and zero, heads
    as the MMAs' N: groups of 3, 2, 16, 8 and 2; 2 and 3 stages) at the Triton kernel's
    accuracy."""
    from kvfit.kernels.decode_int4 import gluon_available

    if not gluon_available():
        pytest.skip("the Gluon int4 decode needs a Hopper GPU and Gluon's Hopper module")
    err = run_check(torch.device("cuda"), dtype, LENS, hq, hkv, d, 5e-3, num_splits=splits,
                    num_stages=stages, gluon=True)
    print(f"gluon hq={hq} hkv={hkv} d={d} splits={splits} stages={stages} {dtype}: rel error "
          f"{err:.2e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,splits,flip", [
    (9, 3, 64, 1, False), (9, 3, 64, 4, True), (16, 8, 128, 1, False), (16, 8, 128, 3, True),
    (16, 8, 128, 5, False), (32, 2, 128, 2, False), (8, 1, 256, 2, False),
    (8, 4, 256, 1, True)])
def test_int4_decode_regs_matches_reference(hq, hkv, d, splits, flip, dtype):
    """The register int4 kernel over token-minor V pages (decode_int4_regs_kernel: K and V^T
    converted straight into the MMAs' A operands; splits ending on one page of a tile, the
    residual page as an extra tile) at the Triton kernel's accuracy, with its default launch
    (REGS_TILES) and, ``flip``, K's scales loaded the other way (ahead or at their tile)."""
    from kvfit.kernels import decode_int4
    from kvfit.kernels.decode_int4 import REGS_TILES, gluon_available

    if not gluon_available():
        pytest.skip("the Gluon int4 decode needs a Hopper GPU and Gluon's Hopper module")
    _, maxnreg, ahead = REGS_TILES[d]
    err = run_check(torch.device("cuda"), dtype, LENS, hq, hkv, d, 5e-3, num_splits=splits,
                    gluon=True, v_layout="HDN", maxnreg=maxnreg, ks_ahead=ahead != flip)
    assert not decode_int4._gluon_failures  # the kernel ran (not the Triton fallback)
    print(f"regs hq={hq} hkv={hkv} d={d} splits={splits} ahead={ahead != flip} {dtype}: rel "
          f"error {err:.2e}")


@pytest.mark.parametrize("hq,hkv,d,splits", [(9, 3, 64, 1), (16, 8, 128, 3), (8, 4, 256, 2)])
def test_int4_decode_regs_exchanged_maximum_matches(monkeypatch, hq, hkv, d, splits):
    """``decode_int4.EXCHANGE_MAX``: the register kernel's tile maximum through shared memory
    with one barrier is the maximum Gluon's reduction computes, so the same seeded problem
    gives the same error against the float64 reference, to the last bit of the float, and
    within the kernel's tolerance."""
    from kvfit.kernels import decode_int4
    from kvfit.kernels.decode_int4 import REGS_TILES, gluon_available

    if not gluon_available():
        pytest.skip("the Gluon int4 decode needs a Hopper GPU and Gluon's Hopper module")
    _, maxnreg, ahead = REGS_TILES[d]
    errs = []
    for on in (False, True):
        monkeypatch.setattr(decode_int4, "EXCHANGE_MAX", on)
        errs.append(run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3,
                              num_splits=splits, gluon=True, v_layout="HDN", maxnreg=maxnreg,
                              ks_ahead=ahead))
        assert not decode_int4._gluon_failures
    assert errs[0] == errs[1], errs


@pytest.mark.parametrize("hq,hkv,d,splits", [(9, 3, 64, 2), (16, 8, 128, 3), (8, 1, 256, 1)])
def test_int4_decode_triton_reads_token_minor_v(hq, hkv, d, splits):
    """The Triton kernel (the register kernel's fallback) over token-minor V pages."""
    err = run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3,
                    num_splits=splits, num_warps=8 if d >= 256 else 4, v_layout="HDN")
    print(f"triton HDN hq={hq} hkv={hkv} d={d} splits={splits}: rel error {err:.2e}")


@pytest.mark.parametrize("hq,hkv,d,splits", [(9, 3, 64, 1), (16, 8, 128, 1), (16, 8, 128, 3),
                                             (16, 8, 128, 5), (8, 4, 256, 2)])
def test_int4_decode_regs_l2_prefetch_matches(hq, hkv, d, splits):
    """``Int4DecodeConfig.l2_ahead`` (``REGS_L2_AHEAD``): asking L2 for the lines of tiles 2 or
    3 ahead changes what the caches hold, not what the kernel computes: the same seeded problem
    gives the same output bit for bit, within the kernel's tolerance of the float64 reference,
    splits shorter than the distance included (LENS' short requests, 5 splits)."""
    from kvfit.kernels import decode_int4
    from kvfit.kernels.decode_int4 import REGS_TILES, gluon_available

    if not gluon_available():
        pytest.skip("the Gluon int4 decode needs a Hopper GPU and Gluon's Hopper module")
    _, maxnreg, ahead = REGS_TILES[d]
    outs = []
    for a in (0, 2, 3):
        run_check(torch.device("cuda"), torch.bfloat16, LENS, hq, hkv, d, 5e-3,
                  num_splits=splits, gluon=True, v_layout="HDN", maxnreg=maxnreg,
                  ks_ahead=ahead, l2_ahead=a, outs=outs)
    assert not decode_int4._gluon_failures
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
