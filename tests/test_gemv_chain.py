"""The GEMV chain kernel of the megakernel benchmark (benchmarks/kernels/gemv_chain_kernel.py) on the CPU under the Triton interpreter: every
layer's four products in one launch (one program: the interpreter runs programs one after
another, so a grid that waits on itself can only be one program there; the GPU bench
benchmarks/kernels/gemv_chain_bench.py checks the full grid against separate GEMVs), against a
float64 chain rounded to float16 after each product as the kernel rounds; the counts end at the
grid size and no wait timed out; shapes the tiles do not divide are refused."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag is process-wide: never set it next to a GPU
    pytest.skip("Triton-interpreter tests run on CPU-only machines; the GPU runs "
                "benchmarks/kernels/gemv_chain_bench.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                "kernels"))
from gemv_chain_kernel import run_chain  # noqa: E402

SHAPES = [(64, 32), (32, 32), (96, 32), (32, 48)]  # qkv, o, gate/up, down (N, K)
TILES = [(8, 16), (4, 32), (8, 16), (4, 16)]


@pytest.mark.parametrize("prefetch,early", [(0, False), (1, False), (2, True)])
def test_chain_matches_the_products_one_by_one(prefetch, early):
    g = torch.Generator().manual_seed(11 + prefetch)
    layers = 3
    ws = [(torch.randn(layers, n, k, generator=g) / k ** 0.5).half() for n, k in SHAPES]
    x0 = torch.randn(32, generator=g).half()
    buf = torch.full((4, 96), float("nan"), dtype=torch.float16)  # poisoned slots
    buf[0, :32] = x0
    cnt = torch.zeros(4 * layers, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    run_chain(buf, ws, TILES, cnt, err, programs=1, stages=2, prefetch_blocks=prefetch,
              early=early)
    x = x0.double()
    for layer in range(layers):
        for j, (n, k) in enumerate(SHAPES):
            y = ws[j][layer].double() @ x[:k]
            got = buf[(j + 1) % 4, :n].double() if layer == layers - 1 else None
            x = y.half().double()  # the kernel rounds each product's output once
            if got is not None:  # the last layer's slots hold its four outputs
                tol = 2.0 ** -10 * y.abs() + 1e-3 * y.abs().max()
                assert ((got - y).abs() <= tol).all(), (j, (got - y).abs().max())
    assert cnt.tolist() == [1] * (4 * layers) and err.item() == 0


def test_shapes_the_tiles_do_not_divide_are_refused():
    ws = [torch.zeros(1, n, k, dtype=torch.float16) for n, k in SHAPES]
    buf = torch.zeros(4, 96, dtype=torch.float16)
    cnt, err = torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="product 1"):
        run_chain(buf, ws, [(8, 16), (5, 32), (8, 16), (4, 16)], cnt, err, programs=1)
    with pytest.raises(ValueError, match="counts"):
        run_chain(buf, ws, TILES, cnt[:2], err, programs=1)
