"""@triton.jit helpers of the decode kernels (split-K and packed): the tile conversion to the MMA
dtype, a split's token range, and a split's output (compiled into callers)."""

from __future__ import annotations

import functools
import types

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build() -> types.SimpleNamespace:
    """``to_mma``/``cvt_one`` (tile conversions), ``split_q_i8`` and ``raw_logits`` (Q.K^T of
    stored keys), ``split_span``/``split_range``/``live_splits`` (the decode splits' cut of a
    context) and
    ``store_split``, built on first use."""
    import triton
    import triton.language as tl

    from kvfit.kernels.row_quant import build as build_row_quant

    rq = build_row_quant()
    i8_to_f16, i8_to_f16_biased = rq.i8_to_f16, rq.i8_to_f16_biased
    round_half_even = rq.round_half_even

    @triton.jit
    def _cvt_one(x, q, F16: tl.constexpr, CVT: tl.constexpr):
        # one int8/8-bit tile -> the MMA dtype. CVT (int8 tiles): 1 four values per asm (no
        # I2F), 2 the same + 1152 (the caller corrects), 0 Triton's cast
        if CVT == 1:
            y = i8_to_f16(x)
        elif CVT == 2:
            y = i8_to_f16_biased(x)
        elif F16:
            y = x.to(tl.float16)
        else:
            y = x.to(q.dtype)
        return y

    @triton.jit
    def _to_mma(k, v, q, F16: tl.constexpr, I8_CVT: tl.constexpr):
        # both tiles with the same conversion (I8_CVT as in _cvt_one)
        tl.static_assert(len(k.shape) == 2)  # (also keeps ``tl`` in this function's closure)
        return _cvt_one(k, q, F16, I8_CVT), _cvt_one(v, q, F16, I8_CVT)

    @triton.jit
    def _split_q_i8(q, PER_ROW: tl.constexpr):
        # q [M, D] -> (hi, lo) int8 [M, D] and the factor f32 ([M, 1] per row, or one scalar
        # for the tile) with q = factor * (254 * hi + lo) up to max|q| / 64516:
        # hi = rint(q / s), lo = rint(254 * (q / s - hi)), s = max |q| / 127 (1 if all zero)
        qf = q.to(tl.float32)
        if PER_ROW:
            amax = tl.max(tl.abs(qf), axis=1)
            sq = tl.where(amax > 0, amax / 127.0, 1.0)
            r = qf / sq[:, None]
            f = (sq / 254.0)[:, None]
        else:
            amax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
            sq = tl.where(amax > 0, amax / 127.0, 1.0)
            r = qf / sq
            f = sq / 254.0
        hi = round_half_even(r)
        lo = round_half_even((r - hi) * 254.0)
        return hi.to(tl.int8), lo.to(tl.int8), f

    @triton.jit
    def _raw_logits(q, q_lo, k, qoff, F16: tl.constexpr, K_CVT: tl.constexpr):
        # q . k over the stored keys k [N, D] (not yet times their scales) -> f32 [M, N].
        # K_CVT 3: q is (hi, lo) int8 (_split_q_i8, qoff its row factor), two int8 MMAs with
        # int32 sums (exact), no conversion of k; 4: the same with one factor for the tile,
        # which the caller folds into the keys' scales (not applied here); 2: biased f16
        # keys, qoff = 1152 * sum(q); 0/1: f16 keys, qoff 0
        if K_CVT == 4:
            kt = tl.trans(k)
            hi = tl.dot(q, kt, out_dtype=tl.int32)
            lo = tl.dot(q_lo, kt, out_dtype=tl.int32)
            qk = (hi * 254 + lo).to(tl.float32)
        elif K_CVT == 3:
            kt = tl.trans(k)
            hi = tl.dot(q, kt, out_dtype=tl.int32)
            lo = tl.dot(q_lo, kt, out_dtype=tl.int32)
            qk = (hi * 254 + lo).to(tl.float32) * qoff
        else:
            qk = tl.dot(q, tl.trans(_cvt_one(k, q, F16, K_CVT)), input_precision="tf32") - qoff
        return qk

    @triton.jit
    def _split_span(KVLEN, b, num_splits, min_per, window, BLOCK_N: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
        # how request b's context is cut into splits: (kv_len, base, per). Split s holds
        # tokens [base + s * per, base + (s + 1) * per) of the context; per is a multiple of
        # BLOCK_N and at least min_per (a multiple of BLOCK_N). With a window, base is the
        # tile holding its first token. The splits with tokens are the first
        # cdiv(kv_len - base, per): the merge counts them the same way.
        kv_len = tl.load(KVLEN + b)
        base = 0
        if HAS_WINDOW:
            base = tl.maximum(kv_len - window, 0) // BLOCK_N * BLOCK_N
        per = tl.maximum(tl.cdiv(tl.cdiv(kv_len - base, num_splits), BLOCK_N) * BLOCK_N,
                         min_per)
        return kv_len, base, per

    @triton.jit
    def _live_splits(KVLEN, b, num_splits, min_per, window, BLOCK_N: tl.constexpr,
                     HAS_WINDOW: tl.constexpr):
        # how many of request b's splits hold tokens (the first ones, as _split_span cuts)
        kv_len, base, per = _split_span(KVLEN, b, num_splits, min_per, window, BLOCK_N,
                                        HAS_WINDOW)
        return tl.cdiv(kv_len - base, tl.maximum(per, BLOCK_N))

    @triton.jit
    def _split_range(KVLEN, b, s, num_splits, min_per, window, BLOCK_N: tl.constexpr,
                     HAS_WINDOW: tl.constexpr):
        # tokens [lo, hi) of split s of request b (_split_span's cut): a context shorter than
        # num_splits tiles (a CUDA graph fixes num_splits from the longest context) fills the
        # first splits, a tile each (or min_per tokens), and leaves the rest empty (lo >= hi).
        # With a window the splits share only the window's tiles, so a long request's splits
        # all have work and none reads a freed page.
        kv_len, base, per = _split_span(KVLEN, b, num_splits, min_per, window, BLOCK_N,
                                        HAS_WINDOW)
        lo = base + s * per
        hi = tl.minimum(lo + per, kv_len)
        if HAS_WINDOW:
            lo = tl.maximum(lo, kv_len - window)
        return lo, hi

    @triton.jit
    def _store_split(OUT, OP, LSE, acc, m_i, l_i, b, h, s, num_splits, v_scale,
                     stride_ot, stride_oh, G: tl.constexpr, G_PAD: tl.constexpr,
                     D: tl.constexpr, SINGLE: tl.constexpr):
        # normalise; one split: the output (V scale applied), else the partial + its log-sum-exp
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        gmask = g < G
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        hq = h * G + g
        if SINGLE:
            tl.store(OUT + b * stride_ot + hq[:, None] * stride_oh + d[None, :],
                     (o * v_scale).to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + hq) * num_splits + s  # [G_PAD]
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    expose_for_interpreter(globals(), locals())
    return types.SimpleNamespace(to_mma=_to_mma, cvt_one=_cvt_one, split_q_i8=_split_q_i8,
                                 raw_logits=_raw_logits, split_span=_split_span,
                                 live_splits=_live_splits, split_range=_split_range,
                                 store_split=_store_split)
