"""The L2 prefetch (kernels/l2_prefetch.py) on the GPU: it changes no value. Prefetching ranges
of weights (clipped at the tensor's end, unaligned starts, empty ranges) leaves them bit-equal
and faults nowhere; the GEMV path's one-token logits have the same bits with the prefetch of the
next weights on and off, eager and from CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from kvhelpers import DEV

pytestmark = pytest.mark.gpu


def test_prefetch_reads_only_and_clips():
    from kvfit.kernels import l2_prefetch

    if not l2_prefetch.supports(torch.device(DEV)):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    g = torch.Generator(device=DEV).manual_seed(5)
    a = torch.randn(4099, 33, device=DEV, generator=g).bfloat16()  # odd sizes: ragged ends
    b = torch.randn(1000, device=DEV, generator=g)
    keep_a, keep_b = a.clone(), b.clone()
    l2_prefetch.prefetch_l2([(a, 0, 1 << 40), (b, 3, 777), (a, a.numel() * 2 - 5, 100)])
    l2_prefetch.prefetch_l2([(b, 10 ** 9, 10), (b, 0, 0)])  # nothing left: no launch
    torch.cuda.synchronize()
    assert torch.equal(a, keep_a) and torch.equal(b, keep_b)


@pytest.mark.parametrize("graphed", [True, False])
def test_gemv_logits_bit_equal_with_prefetch(graphed, monkeypatch):
    from kvfit.kernels import l2_prefetch
    from kvfit.models import decode_rows
    from test_cuda_graph import tiny_model
    from test_rows_gemm_cuda import _logits_by_batch

    if not l2_prefetch.supports(torch.device(DEV)):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    monkeypatch.setattr(decode_rows, "ROWS_GEMM", False)
    torch.manual_seed(0)
    cfg, model = tiny_model(128)
    prompts = [torch.randint(0, 512, (int(k),)).tolist() for k in torch.randint(5, 100, (2,))]
    tables = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(2)]
    model.set_decode_gemv(True)
    monkeypatch.setattr(decode_rows, "L2_PREFETCH_BYTES", 0)
    off = _logits_by_batch(model, cfg, "triton", "fp8_e4m3", prompts, tables, [1], graphed)[1]
    monkeypatch.setattr(decode_rows, "L2_PREFETCH_BYTES", 1 << 20)
    on = _logits_by_batch(model, cfg, "triton", "fp8_e4m3", prompts, tables, [1], graphed)[1]
    assert torch.isfinite(off).all()
    assert torch.equal(on, off)
