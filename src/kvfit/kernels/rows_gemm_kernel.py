"""The Triton kernel of ``kernels/rows_gemm.py`` (built once per process on first use).

One program computes a ``[BLOCK_M, BLOCK_N]`` output tile over its share of K: all of K, or
with ``SPLIT`` > 1 the ``pid_s``-th of SPLIT equal ranges, whose float32 partial sums go to a
workspace; the last program of a tile to finish (an atomic counter per tile, reset by that
program) adds the SPLIT partials in split order and runs the epilogue. Every sum a row's output
depends on has a fixed order: tensor-core products chained in K order inside a range, partials
added in split order, and the RMSNorm's sum of squares as chunks of 64 columns (fewer when
K < 64: every tile then has the same BLOCK_K) in K order, each chunk a fixed pairwise tree
(``_chunk_sums``, ``_add_in_order``: the same additions whatever BLOCK_K or the register
layout), per split in split order.
"""

from __future__ import annotations

import functools


@functools.cache
def build():
    import triton
    import triton.language as tl

    from kvfit.kernels.gemm_epilogue import build as build_epilogue
    from kvfit.kernels.interpret import expose_for_interpreter
    from kvfit.kernels.pdl import gdc

    gdc_wait, gdc_launch_dependents = gdc()
    _epilogue = build_epilogue()

    @triton.jit
    def _chunk_sums(v, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_CH: tl.constexpr):
        """[BM, BK] -> [BM, BK >> LOG2_CH]: each run of 2**LOG2_CH lanes summed by a fixed
        pairwise tree (lanes j and j + 1, then pairs of those, ...; never across a run)."""
        for i in tl.static_range(LOG2_CH):
            v = tl.reshape(v, [BLOCK_M, BLOCK_K >> (i + 1), 2])
            a, b = tl.split(v)
            v = a + b
        return v

    @triton.jit
    def _add_in_order(ssq, t, BLOCK_M: tl.constexpr, C: tl.constexpr):
        """ssq [BM] + the C columns of t [BM, C] one after the other, in column order."""
        if C == 1:
            ssq = ssq + tl.reshape(t, [BLOCK_M])
        elif C == 2:
            c0, c1 = tl.split(t)
            ssq = ssq + c0
            ssq = ssq + c1
        else:  # C == 4: (hi, lo) -> column 2 * hi + lo
            even, odd = tl.split(tl.reshape(t, [BLOCK_M, 2, 2]))  # lo 0: columns 0, 2
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            ssq = ssq + c0
            ssq = ssq + c1
            ssq = ssq + c2
            ssq = ssq + c3
        return ssq

    # M is never specialised (1, multiples of 16): one binary per tile for every batch size
    @triton.jit(do_not_specialize=["M"])
    def _rows_gemm_kernel(X, R, RO, NW, W, B, OUT, WS, WSQ, CNT, M, K, N_OUT, K_SPLIT, stride_x,
                          stride_r, stride_ro, stride_w, stride_o, up_off, eps, offset,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          LOG2_CH: tl.constexpr, SPLIT: tl.constexpr,
                          NORM: tl.constexpr, ADD: tl.constexpr, HAS_OFFSET: tl.constexpr,
                          GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          EVEN_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                          F32_DOT: tl.constexpr, SWAP: tl.constexpr):
        if PDL:  # programmatic dependent launch (kernels/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        pid_m = tl.program_id(0)  # fastest: the row blocks of one weight tile run together
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        ty = X.dtype.element_ty
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] batch rows
        mmask = rm < M
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
        nmask = rn < N_OUT
        ks = tl.arange(0, BLOCK_K)
        rm64 = rm.to(tl.int64)
        x_ptr = X + rm64[:, None] * stride_x + ks[None, :]  # [BM, BK]
        r_ptr = R + rm64[:, None] * stride_r + ks[None, :]
        ro_ptr = RO + rm64[:, None] * stride_ro + ks[None, :]
        w_ptr = W + rn.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BN, BK]
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ssq = tl.zeros([BLOCK_M], dtype=tl.float32)  # the rows' sums of squares
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if EVEN_K:
                xm = mmask[:, None]
                wm = nmask[:, None]
            else:
                km = (k0 + ks) < K
                xm = mmask[:, None] & km[None, :]
                wm = nmask[:, None] & km[None, :]
            xk = tl.load(x_ptr + k0, mask=xm, other=0.0)  # [BM, BK]
            if NORM:
                if ADD:  # s = x + residual, rounded like torch's add: the new residual
                    rk = tl.load(r_ptr + k0, mask=xm, other=0.0)
                    xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(ty)
                    if pid_n == 0:
                        tl.store(ro_ptr + k0, xk, mask=xm)
                sf = xk.to(tl.float32)
                # chunks of 2**LOG2_CH columns (64, whatever BLOCK_K) in K order, each a
                # fixed tree: the same additions for every tile of this K
                ssq = _add_in_order(ssq, _chunk_sums(sf * sf, BLOCK_M, BLOCK_K, LOG2_CH),
                                    BLOCK_M, BLOCK_K >> LOG2_CH)
                if EVEN_K:
                    nw = tl.load(NW + k0 + ks).to(tl.float32)
                else:
                    nw = tl.load(NW + k0 + ks, mask=km, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    nw = nw + offset
                hk = (sf * nw[None, :]).to(ty)
            else:
                hk = xk
            w = tl.load(w_ptr + k0, mask=wm, other=0.0)  # [BN, BK]
            if F32_DOT:  # the interpreter's 16-bit dot is wrong for bfloat16: exact widening
                hk = hk.to(tl.float32)
                w = w.to(tl.float32)
            if SWAP:
                acc = tl.dot(w, tl.trans(hk), acc)  # [BN, BM]
            else:
                acc = tl.dot(hk, tl.trans(w), acc)  # [BM, BN]
            if GATED:
                wu = tl.load(w_ptr + up_off * stride_w + k0, mask=wm, other=0.0)
                if F32_DOT:
                    wu = wu.to(tl.float32)
                if SWAP:
                    acc_up = tl.dot(wu, tl.trans(hk), acc_up)
                else:
                    acc_up = tl.dot(hk, tl.trans(wu), acc_up)
        if SWAP:  # [BN, BM] -> [BM, BN]
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        if SPLIT == 1:
            _epilogue(acc, acc_up, ssq, B, OUT, rm64, rn, mmask, nmask, K, stride_o, up_off,
                      eps, NORM, GATED, ACT, HAS_BIAS, ty)
        else:
            # partials: WS [SPLIT, M, N_OUT * (1 + GATED)], WSQ [SPLIT, n_blocks, M] float32
            n_cols = N_OUT * (2 if GATED else 1)
            pmask = mmask[:, None] & nmask[None, :]
            ws_ptr = WS + (pid_s * M + rm64)[:, None] * n_cols + rn[None, :]
            tl.store(ws_ptr, acc, mask=pmask)
            if GATED:
                tl.store(ws_ptr + N_OUT, acc_up, mask=pmask)
            n_blocks = tl.num_programs(1)
            wsq_ptr = WSQ + (pid_s * n_blocks + pid_n) * M + rm64
            if NORM:
                tl.store(wsq_ptr, ssq, mask=mmask)
            tile = pid_m * n_blocks + pid_n
            done = tl.atomic_add(CNT + tile, 1, sem="acq_rel")  # release: partials visible
            if done == SPLIT - 1:  # the last of the tile: add the partials in split order
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                ssq = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    p_ptr = WS + (s * M + rm64)[:, None] * n_cols + rn[None, :]
                    acc += tl.load(p_ptr, mask=pmask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(p_ptr + N_OUT, mask=pmask, other=0.0,
                                          cache_modifier=".cg")
                    if NORM:
                        ssq += tl.load(WSQ + (s * n_blocks + pid_n) * M + rm64, mask=mmask,
                                       other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(CNT + tile, 0)  # ready for the next launch
                _epilogue(acc, acc_up, ssq, B, OUT, rm64, rn, mmask, nmask, K, stride_o,
                          up_off, eps, NORM, GATED, ACT, HAS_BIAS, ty)

    expose_for_interpreter(globals(), locals())
    return _rows_gemm_kernel
