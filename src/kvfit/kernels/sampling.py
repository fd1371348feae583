"""The sampler's draw in two or three Triton launches (CUDA): temperature, min-p, an optional
per-row cutoff (top-k / top-p, computed by the torch path) and the inverse CDF at the row's
uniform, for every row of a step at once.

Semantics are the torch path's (``engine.sampling.sampler``): on a row, ``xs = x / T`` (IEEE
division, as torch's), kept tokens are ``xs >= max(xs) + log(min_p)`` and ``xs >= cutoff``, the
weights ``exp(xs - max(xs))`` of the kept tokens; the drawn token is the first (token-id order)
whose cumulative weight reaches ``u x total``, always a token of positive weight. Greedy rows
(and rows whose every logit is -inf) take the first index of the maximum, as ``argmax``. Sums
run in float32 inside a chunk and float64 across chunks, so a draw may differ from the torch
path's only where ``u x total`` falls within float32 rounding of a boundary between two tokens.

Launches (``CHUNK`` logits per program in the row passes):
1. ``stats`` [N, S]: per chunk the scaled maximum and its first index; without filters also the
   chunk's weight sum on the chunk's own scale (``exp(xs - chunk max)``), so one read suffices;
2. ``sums`` [N, S] (only when a row filters: min-p or a cutoff): the chunk's kept weight sum on
   the row's scale, once the row maximum is known (a second read of the logits);
3. ``select`` [N]: the chunk where the cumulative weight reaches the target, then the token
   inside it (a read of one chunk per row).
Rows with top-p and no top-k get their cutoff from ``top_p`` [R] between 1 and 2, without a
sort: the cutoff is the smallest kept value ``c`` with ``mass(xs > c) < top_p x kept mass``
(the torch path's "mass strictly before < top_p" at the first of a run of ties); ``PASSES``
reads with ``G`` pivots each narrow an interval (lo, hi] around it, a last read gathers the few
values inside and they are sorted in registers. (Top-k rows keep the torch ``topk``: k is small.)
A row's result depends only on that row (one program per row and chunk, fixed shapes): the draw
is batch-invariant. Owns nothing; writes only what it allocates.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

CHUNK = 8192  # logits per program of the row passes
BLOCK = 2048  # logits per iteration of the in-chunk search

# top-p without top-k: PASSES passes of G pivots narrow the cutoff's interval (16^8: below a
# float32 step at any magnitude >= 0.02), then its at most CAP values are sorted in registers
TOP_P_CHUNK = 1024
TOP_P_PIVOTS = 16
TOP_P_PASSES = 8
TOP_P_CAP = 1024
# The pivot kernel runs one program per row through ~10 reads of it: ~2.5 ms whatever the row
# count up to one wave (H200, 151,936 logits: 2.44 ms at 1 row, 2.50 at 64, 3.66 at 256), where
# torch's full sort grows with the rows (0.23, 1.53, 4.94 ms). Below this many top-p rows the
# caller sorts instead.
TOP_P_MIN_ROWS = 160


@functools.cache
def build():
    """The jitted kernels (stats, sums, select, top_p), built once per process on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(X, row, sx, offs, V, t):
        """The row's logits at ``offs`` over the temperature (IEEE division, as torch's): -inf
        past V."""
        x = tl.load(X + row * sx + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(x, tl.zeros_like(x) + t)

    @triton.jit
    def _weights(xs, cut, mx):
        """exp(xs - mx) of the kept values (xs >= cut, finite), 0 elsewhere."""
        return tl.where((xs >= cut) & (xs > float("-inf")), tl.exp(xs - mx), 0.0)

    @triton.jit
    def _stats(X, sx, P, n_rows, V, ST, S, FILTER: tl.constexpr, CH: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * CH + tl.arange(0, CH)
        t = tl.load(P + 0 * n_rows + row).to(tl.float32)  # temperature (1 on greedy rows)
        xs = _scaled(X, row, sx, offs, V, t)
        m = tl.max(xs, 0)
        first = tl.min(tl.where(xs == m, offs, V), 0)  # first index of the chunk maximum
        base = ST + (row * S + c) * 3  # float64 [N, S, 3]: max, its index, weight sum
        tl.store(base, m.to(tl.float64))
        tl.store(base + 1, first.to(tl.float64))
        if not FILTER:
            w = _weights(xs, float("-inf"), m)  # on the chunk's scale; 0 if all -inf
            tl.store(base + 2, tl.sum(w, 0).to(tl.float64))

    @triton.jit
    def _row_max(ST, row, S, SP: tl.constexpr):
        js = tl.arange(0, SP)
        ms = tl.load(ST + (row * S + js) * 3, mask=js < S, other=float("-inf"))
        return tl.max(ms, 0).to(tl.float32)

    @triton.jit
    def _row_cut(P, CUT, n_rows, row, mx, HAS_CUT: tl.constexpr):
        min_p = tl.load(P + 2 * n_rows + row).to(tl.float32)
        cut = mx + tl.log(min_p)  # min_p 0 -> -inf: keeps all
        if HAS_CUT:
            cut = tl.maximum(cut, tl.load(CUT + row))
        return cut

    @triton.jit
    def _sums(X, sx, P, CUT, n_rows, V, ST, S, HAS_CUT: tl.constexpr, CH: tl.constexpr,
              SP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        mx = _row_max(ST, row, S, SP)
        cut = _row_cut(P, CUT, n_rows, row, mx, HAS_CUT)
        t = tl.load(P + 0 * n_rows + row).to(tl.float32)
        xs = _scaled(X, row, sx, c * CH + tl.arange(0, CH), V, t)
        w = _weights(xs, cut, mx)
        tl.store(ST + (row * S + c) * 3 + 2, tl.sum(w, 0).to(tl.float64))

    @triton.jit
    def _select(X, sx, P, CUT, OUT, n_rows, V, ST, S, FILTER: tl.constexpr,
                HAS_CUT: tl.constexpr, CH: tl.constexpr, SP: tl.constexpr, BL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        js = tl.arange(0, SP)
        valid = js < S
        ms = tl.load(ST + (row * S + js) * 3, mask=valid, other=float("-inf"))  # f64 [SP]
        firsts = tl.load(ST + (row * S + js) * 3 + 1, mask=valid, other=0.0)
        sums = tl.load(ST + (row * S + js) * 3 + 2, mask=valid, other=0.0)
        mx64 = tl.max(ms, 0)
        mx = mx64.to(tl.float32)
        argmax = tl.min(tl.where(valid & (ms == mx64), firsts, 2.0 * V), 0).to(tl.int64)
        if FILTER:
            cut = _row_cut(P, CUT, n_rows, row, mx, HAS_CUT)
            lg = sums
        else:
            cut = float("-inf")
            scale = tl.exp((ms - mx64).to(tl.float32)).to(tl.float64)  # chunk -> row scale
            lg = tl.where(valid & (ms > float("-inf")), sums * scale, 0.0)
        total = tl.sum(lg, 0)
        u = tl.load(P + 5 * n_rows + row)
        target = u * total
        # mass strictly before each chunk, [SP]: a masked row sum of the [SP, SP] tile
        before = tl.sum(tl.where(js[None, :] < js[:, None], lg[None, :], 0.0), 1)
        reach = valid & (lg > 0) & (before + lg >= target)
        k = tl.min(tl.where(reach, js, SP), 0)
        k = tl.where(k == SP, tl.max(tl.where(valid & (lg > 0), js, -1), 0), k)  # rounding
        k = tl.maximum(k, 0)
        rest = target - tl.sum(tl.where(js == k, before, 0.0), 0)
        t = tl.load(P + 0 * n_rows + row).to(tl.float32)
        acc = tl.full([], 0.0, tl.float64)
        chosen = tl.full([], -1, tl.int64)
        last = tl.full([], -1, tl.int64)
        for b in range(0, CH, BL):
            offs = k * CH + b + tl.arange(0, BL)
            w = _weights(_scaled(X, row, sx, offs, V, t), cut, mx)
            cw = acc + tl.cumsum(w, 0).to(tl.float64)
            hit = tl.min(tl.where((cw >= rest) & (w > 0), offs, 2 * V), 0).to(tl.int64)
            chosen = tl.where((chosen < 0) & (hit < 2 * V), hit, chosen)
            last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), 0).to(tl.int64))
            acc += tl.sum(w, 0).to(tl.float64)
        chosen = tl.where(chosen < 0, last, chosen)  # rounding: the chunk's last kept token
        greedy = tl.load(P + 4 * n_rows + row) > 0.5
        use_arg = greedy | (mx == float("-inf")) | (total <= 0) | (chosen < 0)
        tl.store(OUT + row, tl.where(use_arg, argmax, chosen))

    @triton.jit
    def _top_p(X, sx, P, ROWS, CUT, BUF, n_rows, V, ST, S, HAS_MIN_P: tl.constexpr,
               CH: tl.constexpr, SP: tl.constexpr, G: tl.constexpr, PASSES: tl.constexpr,
               CAP: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(ROWS + i)
        mx = _row_max(ST, row, S, SP)
        t = tl.load(P + 0 * n_rows + row).to(tl.float32)
        cut0 = float("-inf")
        if HAS_MIN_P:
            cut0 = _row_cut(P, P, n_rows, row, mx, False)
        # the kept mass (min-p applied) and the target
        z = tl.full([], 0.0, tl.float64)
        for c in range(0, V, CH):
            w = _weights(_scaled(X, row, sx, c + tl.arange(0, CH), V, t), cut0, mx)
            z += tl.sum(w, 0).to(tl.float64)
        target = tl.load(P + 1 * n_rows + row) * z  # top_p x kept mass
        # narrow (lo, hi] around the cutoff: mass(xs > hi) < target <= mass(xs > lo)
        lo = mx - 104.0  # exp(-104) is 0 in float32: below it no weight
        hi = mx
        js = tl.arange(0, G)
        for r in range(PASSES):
            piv = lo + (hi - lo) * ((js + 1).to(tl.float32) / (G + 1))  # [G] ascending
            acc = tl.zeros([G], dtype=tl.float64)
            for c in range(0, V, CH):
                xs = _scaled(X, row, sx, c + tl.arange(0, CH), V, t)
                w = _weights(xs, cut0, mx)
                above = tl.where(xs[None, :] > piv[:, None], w[None, :], 0.0)  # [G, CH]
                acc += tl.sum(above, 1).to(tl.float64)
            ok = acc < target  # true from some pivot up (mass above falls as the pivot rises)
            hi = tl.minimum(hi, tl.min(tl.where(ok, piv, float("inf")), 0))
            lo = tl.maximum(lo, tl.max(tl.where(ok, float("-inf"), piv), 0))
        # the values in (lo, hi], the mass above hi and the smallest value above hi
        cnt = tl.full([], 0, tl.int32)
        mass_hi = tl.full([], 0.0, tl.float64)
        above_min = tl.full([], float("inf"), tl.float32)
        for c in range(0, V, CH):
            xs = _scaled(X, row, sx, c + tl.arange(0, CH), V, t)
            kept = (xs >= cut0) & (xs > float("-inf"))
            w = _weights(xs, cut0, mx)
            inside = kept & (xs > lo) & (xs <= hi)
            pos = cnt + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(BUF + i * CAP + pos, xs, mask=inside & (pos < CAP))
            cnt += tl.sum(inside.to(tl.int32), 0)
            mass_hi += tl.sum(tl.where(xs > hi, w, 0.0), 0).to(tl.float64)
            above_min = tl.minimum(above_min, tl.min(tl.where(kept & (xs > hi), xs,
                                                              float("inf")), 0))
        ks = tl.arange(0, CAP)
        vals = tl.load(BUF + i * CAP + ks, mask=ks < cnt, other=float("-inf"))
        vals = tl.sort(vals, 0, descending=True)
        wv = tl.where(vals > float("-inf"), tl.exp(vals - mx), 0.0)
        before = mass_hi + (tl.cumsum(wv, 0) - wv).to(tl.float64)  # mass of those before
        cstar = tl.min(tl.where((vals > float("-inf")) & (before < target), vals,
                                float("inf")), 0)
        cstar = tl.where(cnt == 0, above_min, cstar)
        cstar = tl.where(cnt > CAP, hi, cstar)  # ties beyond CAP: (lo, hi] is one value
        tl.store(CUT + row, tl.maximum(cstar, cut0))

    return _stats, _sums, _select, _top_p


def draw(logits: torch.Tensor, params: torch.Tensor, cutoff: Optional[torch.Tensor] = None,
         any_min_p: bool = True, top_p_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [N, V] (float32/16-bit, rows contiguous), params float64 [6, N] (SamplingBatch's
    packing: temperature, top_p, min_p, top_k, greedy, uniform), cutoff float32 [N] or None
    (keep ``x / T >= cutoff``; mutated: the top-p rows' cutoffs are written into it) ->
    int64 [N] drawn ids on the logits' device. ``any_min_p``: whether any row sets min-p (False
    skips the second pass over the logits). ``top_p_rows``: int64 [R] rows with top-p and no
    top-k, whose cutoff the ``_top_p`` kernel finds without sorting."""
    import triton

    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    s = triton.cdiv(v, CHUNK)
    sp = triton.next_power_of_2(s)
    stats = torch.empty((n, s, 3), dtype=torch.float64, device=logits.device)
    stats_k, sums_k, select_k, top_p_k = build()
    if top_p_rows is not None and cutoff is None:
        cutoff = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    filt = any_min_p or cutoff is not None
    cut = cutoff if cutoff is not None else out  # never read without HAS_CUT
    stats_k[(n, s)](logits, logits.stride(0), params, n, v, stats, s, FILTER=filt, CH=CHUNK,
                    num_warps=8)
    if top_p_rows is not None:
        r = top_p_rows.numel()
        buf = torch.empty((r, TOP_P_CAP), dtype=torch.float32, device=logits.device)
        top_p_k[(r,)](logits, logits.stride(0), params, top_p_rows, cut, buf, n, v, stats, s,
                      HAS_MIN_P=any_min_p, CH=TOP_P_CHUNK, SP=sp, G=TOP_P_PIVOTS,
                      PASSES=TOP_P_PASSES, CAP=TOP_P_CAP, num_warps=8)
    if filt:
        sums_k[(n, s)](logits, logits.stride(0), params, cut, n, v, stats, s,
                       HAS_CUT=cutoff is not None, CH=CHUNK, SP=sp, num_warps=8)
    select_k[(n,)](logits, logits.stride(0), params, cut, out, n, v, stats, s, FILTER=filt,
                   HAS_CUT=cutoff is not None, CH=CHUNK, SP=sp, BL=BLOCK, num_warps=4)
    return out
