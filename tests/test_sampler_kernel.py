"""The fused CUDA draw (kernels/sampling.py) on the CPU under Triton's interpreter, against the
torch path of the sampler (itself checked against the exact filtered softmax by chi-square in
test_sampler.py): the same token on every row for fresh random logits and (seed, position), with
several chunks per row and a last partial chunk, mixed greedy / temperature / top-k / top-p /
min-p rows, ties at a cutoff, rows whose every logit is -inf, 16-bit logits, and the draw of a
row independent of the rest of the batch."""

from __future__ import annotations

import pytest
import torch

import triton_interp

pytest.importorskip("triton")
if not triton_interp.enable():
    pytest.skip("a CUDA machine runs the compiled kernel (tests/gpu/test_sampler_cuda.py)",
                allow_module_level=True)

from kvfit.engine.sampling import SamplingBatch, sample  # noqa: E402
from kvfit.engine.sampling import sampler as sampler_mod  # noqa: E402
from kvfit.kernels import sampling as kern  # noqa: E402
from kvfit.sampling_params import SamplingParams as SP  # noqa: E402

KINDS = [SP(temperature=0), SP(temperature=0.6), SP(temperature=0.7, top_k=50, top_p=0.95),
         SP(temperature=0.8, top_p=0.9), SP(temperature=1.0, min_p=0.05),
         SP(temperature=1.1, top_k=20), SP(temperature=1.3, top_k=3, min_p=0.2)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Several chunks per row at a small vocabulary (the last one partial), as at 151,936."""
    monkeypatch.setattr(kern, "CHUNK", 128)
    monkeypatch.setattr(kern, "BLOCK", 32)
    monkeypatch.setattr(kern, "TOP_P_CHUNK", 64)
    monkeypatch.setattr(kern, "TOP_P_CAP", 64)
    monkeypatch.setattr(kern, "TOP_P_MIN_ROWS", 1)  # top-p rows through the pivot kernel


def test_few_top_p_rows_are_sorted_instead(monkeypatch):
    monkeypatch.setattr(kern, "TOP_P_MIN_ROWS", 3)
    calls = []
    real = kern.draw
    monkeypatch.setattr(kern, "draw", lambda *a: calls.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(2)
    for n in (2, 3):
        b = _batch([SP(temperature=0.9, top_p=0.8)] * n, list(range(n)), [4] * n, 200)
        logits = torch.randn(n, 200, generator=g)
        assert _fused(logits, b).tolist() == sample(logits, b).token_ids.tolist()
    assert calls[0] is None and calls[1] is not None  # 2 rows: sorted; 3: the pivot kernel


def _fused(logits, batch):
    """What ``sample`` runs on CUDA (``_draw_fused``), called on CPU tensors."""
    return sampler_mod._draw_fused(logits, batch) if not batch.all_greedy else None


def _batch(params, seeds, positions, vocab):
    return SamplingBatch.build(params, seeds, positions, vocab, "cpu")


@pytest.mark.parametrize("vocab,n,seed", [(1000, 42, 0), (517, 21, 1)])
def test_fused_draw_equals_torch_path(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    params = [KINDS[i % len(KINDS)] for i in range(n)]
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, :5] += 4  # a head, so the filters keep a few tokens and cut the rest
    seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
    positions = torch.randint(0, 10_000, (n,), generator=g).tolist()
    b = _batch(params, seeds, positions, vocab)
    want = sample(logits, b).token_ids  # the CPU path: torch ops
    got = _fused(logits, b)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    # greedy rows are the argmax
    assert got[0::len(KINDS)].tolist() == logits[0::len(KINDS)].argmax(-1).tolist()


def test_fused_draw_rows_are_independent_of_the_batch():
    g = torch.Generator().manual_seed(3)
    vocab, n = 300, 12
    params = [KINDS[i % len(KINDS)] for i in range(n)]
    logits = torch.randn(n, vocab, generator=g) * 2
    seeds, positions = list(range(50, 50 + n)), list(range(n))
    full = _fused(logits, _batch(params, seeds, positions, vocab)).tolist()
    for i in (1, 4, 9):
        one = _fused(logits[i:i + 1], _batch([params[i]], [seeds[i]], [positions[i]], vocab))
        assert one.tolist() == [full[i]]


def test_fused_draw_edges():
    vocab = 400
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, vocab, generator=g)
    logits[0] = float("-inf")  # nothing allowed (a bitmask can do this): the argmax, token 0
    logits[1, 250] = 30.0  # one token holds all the mass, in the second chunk
    logits[2, 7] = logits[2, 300] = 9.0  # a tie at the top-1 cutoff: both stay candidates
    logits[3, :] = 0.0
    logits[3, 399] = 5.0  # the maximum in the last, partial chunk
    params = [SP(temperature=0.7), SP(temperature=1.0), SP(temperature=1.0, top_k=1),
              SP(temperature=0.5, min_p=0.9), SP(temperature=0), SP(temperature=2.0)]
    b = _batch(params, list(range(6)), [11] * 6, vocab)
    got = _fused(logits, b).tolist()
    assert got[0] == 0 and got[1] == 250 and got[2] in (7, 300) and got[3] == 399
    assert got[4] == int(logits[4].argmax())
    assert all(0 <= t < vocab for t in got)
    # over many draws the tie at the top-1 cutoff gives both tokens, and nothing else
    n = 64
    tie = logits[2:3].expand(n, vocab).contiguous()
    bt = _batch([params[2]] * n, list(range(n)), [5] * n, vocab)
    assert set(_fused(tie, bt).tolist()) == {7, 300}


def test_fused_draw_reads_16_bit_logits():
    g = torch.Generator().manual_seed(5)
    vocab, n = 300, 14
    params = [KINDS[i % len(KINDS)] for i in range(n)]
    logits = (torch.randn(n, vocab, generator=g) * 3).bfloat16()
    b = _batch(params, list(range(n)), [3] * n, vocab)
    assert _fused(logits, b).tolist() == sample(logits, b).token_ids.tolist()


def test_top_p_alone_cutoff_equals_the_sort():
    """Rows with top-p and no top-k take their cutoff from the pivot kernel, not a sort: the
    same cutoff value as the torch sort on every row, min-p or not, and the same tokens; a row
    whose values all tie at the cutoff keeps them all (more tied values than the kernel's
    candidate buffer)."""
    g = torch.Generator().manual_seed(9)
    vocab, n = 300, 10
    kinds = [SP(temperature=0.8, top_p=0.9), SP(temperature=1.0, top_p=0.5, min_p=0.05),
             SP(temperature=0.6, top_p=0.99), SP(temperature=1.3, top_p=0.3),
             SP(temperature=0.7)]
    params = [kinds[i % len(kinds)] for i in range(n)]
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[3] = 1.5  # every value tied: all 300 stay candidates
    b = _batch(params, list(range(n)), list(range(n)), vocab)
    assert b.top_p_rows is not None and b.top_k_rows is None
    cut = torch.full((n,), float("-inf"))
    got = kern.draw(logits, b.params, cut, b.any_min_p, b.top_p_rows).tolist()
    want_cut = sampler_mod._cutoffs(logits / b.temperature.unsqueeze(1), b)
    for r in b.top_p_rows.tolist():
        assert cut[r].item() == want_cut[r].item(), r
    assert got == sample(logits, b).token_ids.tolist()
    tied = kern.draw(logits[3:4].expand(64, vocab).contiguous(),
                     _batch([params[3]] * 64, list(range(64)), [1] * 64, vocab).params, None,
                     False, torch.zeros(64, dtype=torch.int64).add_(torch.arange(64)))
    assert len(set(tied.tolist())) > 40  # all 300 tokens candidates: many distinct draws
