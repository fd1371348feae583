"""The batched sampler: distributions against the exact filtered softmax (chi-square), seeded
reproducibility (alone, batched, reordered, preempted), filter edges, logit_bias, the
structured-output bitmask, logprobs only where asked."""

from __future__ import annotations

import math

import pytest
import torch

from kvfit.engine.sampling import SamplingBatch, apply_token_bitmask, sample, unpack_bitmask
from kvfit.engine.sampling.randomness import uniforms
from kvfit.errors import RequestRejected
from kvfit.sampling_params import SamplingParams as SP


def _batch(params, seeds=None, positions=None, vocab=None):
    n = len(params)
    seeds = list(range(1000, 1000 + n)) if seeds is None else seeds
    positions = [7] * n if positions is None else positions
    return SamplingBatch.build(params, seeds, positions, vocab, "cpu")


def _ids(logits, params, seeds=None, positions=None, bitmask=None):
    b = _batch(params, seeds, positions, logits.shape[-1])
    return sample(logits, b, bitmask).token_ids.tolist()


def _reference_probs(row: torch.Tensor, p: SP) -> torch.Tensor:
    """The documented filtered distribution, computed in float64 one step at a time."""
    x = row.double().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    x = x / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.sort(x, descending=True).values[p.top_k - 1]
        x[x < kth] = -math.inf
    if p.min_p > 0:
        probs = torch.softmax(x, 0)
        x[probs < p.min_p * probs.max()] = -math.inf
    if p.top_p < 1:
        vals = torch.sort(x, descending=True).values
        probs = torch.softmax(vals, 0)
        kept = vals[(probs.cumsum(0) - probs) < p.top_p]
        x[x < kept.min()] = -math.inf
    return torch.softmax(x, 0)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at the normal z (3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DIST_CASES = [
    SP(temperature=1.0),
    SP(temperature=0.6),
    SP(temperature=1.7, top_k=4),
    SP(temperature=1.0, top_p=0.6),
    SP(temperature=0.9, min_p=0.15),
    SP(temperature=1.3, top_k=7, top_p=0.8, min_p=0.05),
    SP(temperature=0.8, top_p=0.9, min_p=0.1),
    SP(temperature=1.0, top_k=5, logit_bias={0: 3.0, 3: -2.5}),
]


@pytest.mark.parametrize("case", range(len(DIST_CASES)))
def test_distribution_matches_exact_filtered_softmax(case):
    p = DIST_CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    vocab, draws = 16, 24000
    row = torch.randn(vocab, generator=g) * 0.8
    logits = row.expand(draws, vocab).contiguous()
    # every draw is its own (seed, position): mixes both counters
    seeds = torch.randint(0, 2**62, (draws,), generator=g).tolist()
    positions = torch.randint(0, 100_000, (draws,), generator=g).tolist()
    ids = torch.tensor(_ids(logits, [p] * draws, seeds, positions))
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = _reference_probs(row, p) * draws
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert df >= 2 and chi2 < _chi2_critical(df), (chi2, df, counts, expected)


def test_distribution_across_cdf_blocks():
    # the CDF is inverted in two levels (128-token blocks); put the mass in many blocks, the last
    # one partial (V = 1000), and check the draws against the exact softmax
    g = torch.Generator().manual_seed(11)
    vocab, draws = 1000, 30000
    row = torch.full((vocab,), -12.0)
    hot = torch.tensor([0, 3, 127, 128, 129, 255, 256, 400, 511, 640, 767, 768, 900, 998, 999])
    row[hot] = torch.randn(len(hot), generator=g)
    p = SP(temperature=1.0, min_p=1e-4)  # min-p keeps the hot tokens, drops the rest
    ids = torch.tensor(_ids(row.expand(draws, vocab).contiguous(), [p] * draws,
                            list(range(draws)), [9] * draws))
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = _reference_probs(row, p) * draws
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(hot.tolist())
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert df == len(hot) - 1 and chi2 < _chi2_critical(df), (chi2, df)
    # without a filter every token is live: the cold tail together gets its exact share
    q = SP(temperature=1.0)
    ids = torch.tensor(_ids(row.expand(draws, vocab).contiguous(), [q] * draws,
                            list(range(draws)), [9] * draws))
    probs = _reference_probs(row, q)
    cold = torch.ones(vocab, dtype=torch.bool)
    cold[hot] = False
    counts = torch.bincount(ids, minlength=vocab).double()
    cats_obs = torch.cat([counts[hot], counts[cold].sum()[None]])
    cats_exp = torch.cat([probs[hot], probs[cold].sum()[None]]) * draws
    chi2 = float(((cats_obs - cats_exp) ** 2 / cats_exp).sum())
    assert chi2 < _chi2_critical(len(hot)), chi2


def test_uniforms_are_uniform_and_pure():
    g = torch.Generator().manual_seed(0)
    n = 50_000
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g).tolist()
    pos = torch.randint(0, 2**31, (n,), generator=g).tolist()
    u = torch.from_numpy(uniforms(seeds, pos))
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    counts = torch.histc(u, bins=50, min=0, max=1)
    chi2 = float(((counts - n / 50) ** 2 / (n / 50)).sum())
    assert chi2 < _chi2_critical(49)
    # consecutive positions of one seed are uniform and uncorrelated too
    one = torch.from_numpy(uniforms([12345] * n, range(n)))
    assert abs(float(one.mean()) - 0.5) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([one[:-1], one[1:]]))[0, 1])) < 0.02
    # a row's value depends on its own (seed, position) only; seeds are taken mod 2^64
    sub = torch.from_numpy(uniforms(seeds[10:20][::-1], pos[10:20][::-1]))
    assert torch.equal(sub, u[10:20].flip(0))
    assert uniforms([-1, 2**64 + 5], [3, 3]).tolist() == uniforms([2**64 - 1, 5], [3, 3]).tolist()
    assert len(set(uniforms([1, 2, 1], [5, 5, 6]).tolist())) == 3


def test_seeded_rows_same_alone_batched_and_reordered():
    g = torch.Generator().manual_seed(3)
    vocab = 300
    rows = torch.randn(5, vocab, generator=g) * 3
    params = [SP(temperature=0.8, top_k=5), SP(temperature=1.0), SP(temperature=0.7, top_p=0.9),
              SP(temperature=0), SP(temperature=1.2, top_k=40, min_p=0.02, top_p=0.95)]
    seeds, positions = [11, 22, 33, 44, 55], [3, 9, 27, 81, 243]
    for trial in range(20):  # several positions: different draws, same invariance
        pos = [q + trial for q in positions]
        alone = [_ids(rows[i:i + 1], [params[i]], [seeds[i]], [pos[i]])[0] for i in range(5)]
        assert _ids(rows, params, seeds, pos) == alone
        order = [4, 2, 0, 3, 1]
        assert _ids(rows[order], [params[i] for i in order], [seeds[i] for i in order],
                    [pos[i] for i in order]) == [alone[i] for i in order]
    # different seeds at the same position do differ somewhere
    many = _ids(rows[1:2].expand(64, vocab), [params[1]] * 64, list(range(64)), [5] * 64)
    assert len(set(many)) > 10


def test_greedy_rows_are_exact_argmax_mixed_with_sampled_rows():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(32, 1000, generator=g) * 4
    params = [SP(temperature=0) if i % 2 else SP(temperature=1.5, top_p=0.95) for i in range(32)]
    ids = _ids(logits, params)
    argmax = logits.argmax(-1).tolist()
    assert all(ids[i] == argmax[i] for i in range(1, 32, 2))
    assert sum(ids[i] != argmax[i] for i in range(0, 32, 2)) > 3  # the sampled rows do sample


def test_filter_edges_reduce_to_greedy():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 500, generator=g) * 2
    logits[0, 0] = 80.0  # large logits with a tiny temperature must not overflow into NaN
    argmax = logits.argmax(-1).tolist()
    for p in (SP(temperature=1.0, top_k=1), SP(temperature=2.0, top_p=1e-6), SP(temperature=1e-30),
              SP(temperature=1.0, min_p=1.0), SP(temperature=50.0, top_k=1, top_p=0.5)):
        assert _ids(logits, [p] * 40, positions=list(range(40))) == argmax, p


def test_top_k_larger_than_vocab_is_no_filter():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 50, generator=g)
    seeds, pos = list(range(64)), list(range(100, 164))
    assert (_ids(logits, [SP(top_k=10_000)] * 64, seeds, pos)
            == _ids(logits, [SP(top_k=-1)] * 64, seeds, pos))


def test_ties_at_a_cutoff_are_kept():
    row = torch.tensor([3.0, 1.0, 3.0, 0.5, 3.0, -1.0])
    n = 3000
    ids = _ids(row.expand(n, 6).contiguous(), [SP(top_k=1)] * n, positions=list(range(n)))
    counts = torch.bincount(torch.tensor(ids), minlength=6)
    assert counts[[1, 3, 5]].sum() == 0 and bool((counts[[0, 2, 4]] > 850).all())
    assert _ids(row[None], [SP(temperature=0)]) == [0]  # greedy: the first maximum


def test_logit_bias_forces_and_bans():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 200, generator=g) * 3
    forced = [SP(temperature=t, logit_bias={17: 100.0}) for t in (0, 1.0, 0.5, 1.5)] * 16
    assert _ids(logits, forced, positions=list(range(64))) == [17] * 64
    argmax = logits.argmax(-1)
    banned = [SP(temperature=0, logit_bias={int(argmax[i]): -100.0}) for i in range(64)]
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert _ids(logits, banned) == second
    top = int(logits[0].argmax())
    row = logits[0:1].expand(2000, 200)
    sampled = _ids(row, [SP(temperature=1.0, logit_bias={top: -100.0})] * 2000,
                   positions=list(range(2000)))
    assert top not in sampled


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> int32 [N, ceil(V/32)] in xgrammar's packing (reference packer)."""
    n, v = allowed.shape
    words = (v + 31) // 32
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    packed = (padded.view(n, words, 32) << torch.arange(32)).sum(-1)  # [N, W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_bitmask_masks_everything_including_greedy():
    g = torch.Generator().manual_seed(8)
    n, v = 48, 100  # 100 is not a multiple of 32: the last word is partial
    logits = torch.randn(n, v, generator=g) * 3
    allowed = torch.rand(n, v, generator=g) < 0.1
    allowed[:, 99] = True
    allowed[::3] = True  # unconstrained rows: all ones
    mask = _bitmask(allowed)
    mask[::3] = -1  # xgrammar's unconstrained rows: every bit set, padding bits included
    assert torch.equal(unpack_bitmask(mask, v), allowed)
    assert torch.equal(apply_token_bitmask(logits, mask),
                       torch.where(allowed, logits, torch.tensor(float("-inf"))))
    params = [SP(temperature=0) if i % 2 else SP(temperature=1.0, top_k=20) for i in range(n)]
    ids = _ids(logits, params, bitmask=mask)
    assert all(bool(allowed[i, t]) for i, t in enumerate(ids))
    plain = _ids(logits, params)
    assert [ids[i] for i in range(0, n, 3)] == [plain[i] for i in range(0, n, 3)]
    masked = logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    assert [ids[i] for i in range(1, n, 2)] == [masked[i] for i in range(1, n, 2)]


def test_no_nan_or_bad_id_with_minus_inf_rows():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 40, generator=g)
    logits[0, :30] = float("-inf")  # mostly -inf from the model
    mask = torch.full((6, 2), -1, dtype=torch.int32)
    mask[1] = 0  # nothing allowed at all
    params = [SP(temperature=1.0, top_p=0.9, min_p=0.1), SP(temperature=1.0, top_k=3),
              SP(temperature=0.5), SP(temperature=0), SP(min_p=0.5), SP(top_k=2)]
    out = sample(logits, _batch(params, vocab=40), mask)
    ids = out.token_ids.tolist()
    assert all(0 <= t < 40 for t in ids) and ids[0] >= 30 and ids[1] == 0


def test_logprobs_only_for_rows_that_ask_raw_distribution():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 64, generator=g) * 2
    params = [SP(temperature=0.5, top_k=3, logprobs=2, logit_bias={5: 4.0}), SP(temperature=1),
              SP(temperature=0, logprobs=0), SP(temperature=1.0)]
    out = sample(logits, _batch(params, vocab=64))
    ids = out.token_ids.tolist()
    d = out.logprob_dicts(ids)
    assert sorted(d) == [0, 2]
    raw = torch.log_softmax(logits.double(), -1)  # before bias, temperature and filters
    for row, n in ((0, 2), (2, 0)):
        assert ids[row] in d[row] and abs(d[row][ids[row]] - float(raw[row, ids[row]])) < 1e-5
        top = raw[row].topk(max(n, 1)).indices.tolist()[:n]
        assert set(top) <= set(d[row]) and len(d[row]) <= n + 1
    assert _batch([SP(), SP()], vocab=64).logprob_rows == []


def test_logit_bias_validation():
    assert SP(logit_bias={3: 100, 9: -100.0}).logit_bias == {3: 100.0, 9: -100.0}
    for bad in ({-1: 1.0}, {"5": 1.0}, {1.5: 1.0}, {True: 1.0}, {4: 100.5}, {4: float("nan")},
                {4: float("inf")}, {4: "1"}, [1, 2]):
        with pytest.raises(RequestRejected) as e:
            SP(logit_bias=bad)
        assert e.value.param == "logit_bias"


# -- engine level: the bundled model ------------------------------------------------------------
PROMPTS = ["Tell me a story", "The capital of France is", "def add(a, b):", "Water boils at",
           "List three colors:", "Once upon a time,"]


def _sampled(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_request_same_alone_batched_and_after_preemption(bundled_llm):
    from kvfit import LLM

    seeded = [SP(temperature=0.9, top_p=0.95, top_k=60, seed=7 + i, max_tokens=20,
                 ignore_eos=True) for i in range(len(PROMPTS))]
    alone = [_sampled(bundled_llm, [p], [sp])[0] for p, sp in zip(PROMPTS, seeded)]
    assert _sampled(bundled_llm, PROMPTS, seeded) == alone
    rev = _sampled(bundled_llm, PROMPTS[::-1], seeded[::-1])
    assert rev == alone[::-1]
    # 24 pages of 4 tokens cannot hold 6 requests of ~25 tokens: preemption by recompute
    small = LLM("smollm2-135m", device="cpu", num_pages=24, page_size=4,
                max_num_batched_tokens=5, max_model_len=64)
    assert _sampled(small, PROMPTS, seeded) == alone
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.allocator.num_free == small.engine.allocator.num_pages


def test_unseeded_runs_repeat_from_the_engine_seed():
    from kvfit import LLM

    sp = SP(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [_sampled(LLM("smollm2-135m", device="cpu", num_tokens=2048, max_model_len=256),
                     PROMPTS[:3], sp) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_engine_logit_bias_and_vocab_check(bundled_llm):
    eng = bundled_llm.engine
    forced = SP(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={1234: 100})
    assert _sampled(bundled_llm, ["Hello"], forced) == [[1234] * 6]
    with pytest.raises(RequestRejected) as e:
        eng.add_request("lb", "Hello", SP(logit_bias={eng.vocab_size: 1.0}))
    assert e.value.param == "logit_bias" and not eng.has_unfinished_requests()


def test_engine_logprobs_only_when_asked(bundled_llm):
    outs = bundled_llm.generate(["The sky is", "The sky is"],
                                [SP(temperature=0.8, seed=3, max_tokens=5, logprobs=2),
                                 SP(temperature=0.8, seed=3, max_tokens=5)], use_tqdm=False)
    with_lp, without = outs[0].outputs[0], outs[1].outputs[0]
    assert with_lp.token_ids == without.token_ids
    assert without.logprobs is None and without.cumulative_logprob is None
    assert len(with_lp.logprobs) == 5 and all(len(d) >= 2 for d in with_lp.logprobs)
    assert abs(with_lp.cumulative_logprob
               - sum(d[t] for t, d in zip(with_lp.token_ids, with_lp.logprobs))) < 1e-4
