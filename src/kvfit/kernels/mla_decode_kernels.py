"""The MLA decode kernel with the heads as the MMAs' N dimension (Triton): ``kernels.mla``'s
``mla_decode`` runs it when ``MLAConfig.swap`` is set (16- and 8-bit latents; float32 keeps the
row kernel of ``mla_kernels``).

Why swap. A decode program holds the 16 heads of one request. With the heads as M (the row
kernel), each MMA is ``[16, 576] x [576, N]``: too few rows for Hopper's warp-group MMA
(``wgmma`` needs 64), so Triton issues ``mma.sync`` and every warp loads its operands from
shared memory into registers (``ldmatrix``), the query block duplicated in each warp. Swapped,
the latent tile is the M operand and the heads are N:

    s^T [BLOCK_N, H]  = C [BLOCK_N, 512] . q_lat^T [512, H] + K_pe [BLOCK_N, 64] . q_pe^T [64, H]
    o^T [512, H]     += C^T [512, BLOCK_N] . p^T [BLOCK_N, H]

so with ``BLOCK_N >= 64`` both products are warp-group MMAs that read the latent tile straight
from shared memory where the pipelined load put it (``C^T`` as a transposed view of the same
buffer), N = 16 heads, and the float32 accumulator ``o^T [512, H]`` is spread over the warps
(32-64 registers a thread). The online softmax runs down the token axis (axis 0).

fp8 latents are read as 16-bit words and become float16 in registers (one packed ``cvt`` per
word, ``mla_kernels._fp8_pairs_to_f16``) with the query cast to float16; the converted tile then
feeds both products as a 16-bit tile does.

Grid ``(batch * HBLK, splits)``: program (request, block of BLOCK_H heads), split s walks its
share of the request's tokens (multiples of BLOCK_N); one split writes ``OUT`` (times the latent
scale), several write the float32 partials ``OP`` and base-2 log-sum-exp ``LSE`` for the decode
merge kernel. Owns nothing.
"""

from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted swapped decode kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # the Triton interpreter looks them up there

    from kvfit.kernels import mla_kernels

    mla_kernels.build()
    globals()["_fp8_pairs_to_f16"] = mla_kernels._fp8_pairs_to_f16

    @triton.jit
    def _round_e4m3(y):
        # float32 y (|y| <= 448) -> the nearest e4m3 value (ties to even), still float32, so
        # the cast to fp8 after it is exact on the GPU and under the interpreter alike (the
        # interpreter's float32 -> fp8 cast truncates values below 2^-5): the e4m3 quantum of
        # y's binade (3 mantissa bits, subnormal below 2^-6) is 2^(max(e, -6) - 3)
        e = ((y.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.maximum(e, -6)
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = y * ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # y / quantum, exact
        r = (r + 12582912.0) - 12582912.0  # round half to even (|r| < 2^22)
        return r * quantum

    globals()["_round_e4m3"] = _round_e4m3

    @triton.jit
    def _load_tile(n0, hi, C, bt_row, stride_cp, RANK: tl.constexpr, ROPE: tl.constexpr,
                   DC: tl.constexpr, DR: tl.constexpr, SLAB: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAIRS: tl.constexpr,
                   QFP8: tl.constexpr, pages=0, page0=0, MAXP: tl.constexpr = 0):
        # tokens [n0, n0 + BLOCK_N) as stored (MASKED: tokens >= hi read as 0): (the latent
        # tile [BLOCK_N, DC] as stored, the rope tile [BLOCK_N, DR], the latent tile as
        # [BLOCK_N, DC / 2] 16-bit words of two fp8 values when PAIRS). With QFP8 both latent
        # forms are loaded (the second read of the same bytes hits L2): the logits MMAs take
        # the bytes as they are, the P@C operand is converted from the words in registers (a
        # conversion of the byte tile is placed after shared memory, byte-wise gathers).
        # MAXP > 0: the page ids come from ``pages`` [MAXP] (the table entries from page0 on,
        # loaded before the loop), so the tile's addresses need no load of their own
        n = n0 + tl.arange(0, BLOCK_N)
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        nmask = n < hi
        if MAXP > 0:
            slot = tl.minimum(tl.maximum(n // PAGE - page0, 0), MAXP - 1)
            page = tl.gather(pages, slot, 0).to(tl.int64)
        elif MASKED:
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + n // PAGE).to(tl.int64)
        tok = C + page * stride_cp + (n % PAGE) * SLAB  # [BLOCK_N] pointers to the slabs
        if PAIRS:
            d2 = tl.arange(0, DC // 2)
            wptr = tok.to(tl.pointer_type(tl.uint16), bitcast=True)[:, None] + d2[None, :]
            if MASKED or DC != RANK:
                kw = tl.load(wptr, mask=nmask[:, None] & (d2 < RANK // 2)[None, :], other=0)
            else:
                kw = tl.load(wptr)
        if QFP8 or not PAIRS:
            if MASKED or DC != RANK:
                kc = tl.load(tok[:, None] + dc[None, :],
                             mask=nmask[:, None] & (dc < RANK)[None, :], other=0.0)
            else:
                kc = tl.load(tok[:, None] + dc[None, :])
        else:
            kc = kw
        if not PAIRS:
            kw = kc
        if MASKED or DR != ROPE:
            kr = tl.load(tok[:, None] + RANK + dr[None, :],
                         mask=nmask[:, None] & (dr < ROPE)[None, :], other=0.0)
        else:
            kr = tl.load(tok[:, None] + RANK + dr[None, :])
        return kc, kr, kw

    globals()["_load_tile"] = _load_tile

    @triton.jit
    def _tile_logits(kc, kr, kw, qc_t, qr_t, qc_lo, qr_lo, q_sc, qk_scale, PAIRS: tl.constexpr,
                     E5M2: tl.constexpr, ASM: tl.constexpr, QFP8: tl.constexpr):
        # a tile as _load_tile returns it -> (base-2 logits s^T [BLOCK_N, H] f32, the latent
        # tile kv [BLOCK_N, DC] in the P@C MMA's 16-bit type)
        if QFP8:
            # logits from the 8-bit tile as stored: fp8 x fp8 MMAs against the query split in
            # two fp8 parts (q / q_sc = hi + lo / 16, ~8 significant bits as bfloat16); only
            # P@C takes the tile converted to float16
            s_t = tl.dot(kc, qc_t, tl.dot(kc, qc_lo) * 0.0625)  # [BLOCK_N, H]
            s_t = tl.dot(kr, qr_t, tl.dot(kr, qr_lo) * 0.0625 + s_t) * q_sc[None, :]
            kv = _fp8_pairs_to_f16(kw, E5M2, ASM)  # noqa: F821  [BLOCK_N, DC] float16
        else:
            if PAIRS:
                kv = _fp8_pairs_to_f16(kw, E5M2, ASM)  # noqa: F821  [BLOCK_N, DC] float16
            else:
                kv = kc.to(qc_t.dtype)
            s_t = tl.dot(kv, qc_t)  # [BLOCK_N, H]
            s_t = tl.dot(kr.to(qc_t.dtype), qr_t, s_t) * qk_scale
        return s_t, kv

    globals()["_tile_logits"] = _tile_logits

    @triton.jit
    def _tile_softmax_pv(acc_t, m_i, l_i, s_t, kv, n0, hi, BLOCK_N: tl.constexpr,
                         MASKED: tl.constexpr):
        # logits s_t [BLOCK_N, H] of tokens [n0, n0 + BLOCK_N) into the running softmax:
        # acc_t [DC, H] f32 += kv^T . p^T, m_i/l_i [H] base-2 running max and sum; MASKED:
        # tokens >= hi get no weight
        if MASKED:
            n = n0 + tl.arange(0, BLOCK_N)
            s_t = tl.where((n < hi)[:, None], s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p_t = tl.exp2(s_t - m_use[None, :])  # [BLOCK_N, H]
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        acc_t = tl.dot(tl.trans(kv), p_t.to(kv.dtype), acc_t * alpha[None, :])  # [DC, H]
        return acc_t, m_new, l_i

    globals()["_tile_softmax_pv"] = _tile_softmax_pv

    @triton.jit
    def _attend_tile(acc_t, m_i, l_i, kc, kr, kw, qc_t, qr_t, qc_lo, qr_lo, q_sc, n0, hi, qk_scale,
                     BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAIRS: tl.constexpr,
                     E5M2: tl.constexpr, ASM: tl.constexpr, QFP8: tl.constexpr):
        # one tile (as _load_tile returns it) into the running softmax
        s_t, kv = _tile_logits(kc, kr, kw, qc_t, qr_t, qc_lo, qr_lo, q_sc, qk_scale, PAIRS,
                               E5M2, ASM, QFP8)
        return _tile_softmax_pv(acc_t, m_i, l_i, s_t, kv, n0, hi, BLOCK_N, MASKED)

    globals()["_attend_tile"] = _attend_tile

    @triton.jit
    def _swap_tile(acc_t, m_i, l_i, qc_t, qr_t, qc_lo, qr_lo, q_sc, n0, hi, C, bt_row,
                   stride_cp, qk_scale, RANK: tl.constexpr, ROPE: tl.constexpr,
                   DC: tl.constexpr, DR: tl.constexpr, SLAB: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAIRS: tl.constexpr,
                   E5M2: tl.constexpr, ASM: tl.constexpr, QFP8: tl.constexpr):
        kc, kr, kw = _load_tile(n0, hi, C, bt_row, stride_cp, RANK, ROPE, DC, DR, SLAB, PAGE,
                                BLOCK_N, MASKED, PAIRS, QFP8)
        return _attend_tile(acc_t, m_i, l_i, kc, kr, kw, qc_t, qr_t, qc_lo, qr_lo, q_sc, n0, hi,
                            qk_scale, BLOCK_N, MASKED, PAIRS, E5M2, ASM, QFP8)

    globals()["_swap_tile"] = _swap_tile

    @triton.jit
    def _mla_decode_swap(Q, C, BT, KVLEN, OUT, OP, LSE, qk_scale, out_scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
                         num_splits,
                         H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                         DC: tl.constexpr, DR: tl.constexpr, SLAB: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         HBLK: tl.constexpr, SINGLE: tl.constexpr, F16: tl.constexpr,
                         PAIRS: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr,
                         QFP8: tl.constexpr, PREFETCH: tl.constexpr, HOIST: tl.constexpr,
                         MAXP_POW2: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.program_id(1)
        req = pid // HBLK
        hq = (pid % HBLK) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads
        hlive = hq < H
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        q_row = Q + req.to(tl.int64) * stride_qt + hq * stride_qh  # [BLOCK_H]
        qc_t = tl.load(q_row[None, :] + dc[:, None],
                       mask=hlive[None, :] & (dc < RANK)[:, None], other=0.0)  # [DC, BLOCK_H]
        qr_t = tl.load(q_row[None, :] + RANK + dr[:, None],
                       mask=hlive[None, :] & (dr < ROPE)[:, None], other=0.0)  # [DR, BLOCK_H]
        if QFP8:
            # per head: q / q_sc = hi + lo / 16 in the cache's fp8 type, q_sc = amax / 448 (the
            # logit scale folded in); max(., 1e-30) keeps an all-zero head finite
            qf_c = qc_t.to(tl.float32)
            qf_r = qr_t.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(qf_c), axis=0), tl.max(tl.abs(qf_r), axis=0))
            q_sc = tl.maximum(amax, 1e-30) / 448.0  # [BLOCK_H]
            qf_c = qf_c / q_sc[None, :]
            qf_r = qf_r / q_sc[None, :]
            hi_c = _round_e4m3(qf_c)  # noqa: F821
            hi_r = _round_e4m3(qf_r)  # noqa: F821
            qc_t = hi_c.to(C.dtype.element_ty)
            qr_t = hi_r.to(C.dtype.element_ty)
            qc_lo = _round_e4m3((qf_c - hi_c) * 16.0).to(C.dtype.element_ty)  # noqa: F821
            qr_lo = _round_e4m3((qf_r - hi_r) * 16.0).to(C.dtype.element_ty)  # noqa: F821
            q_sc = q_sc * qk_scale
        else:
            if F16:
                qc_t = qc_t.to(tl.float16)
                qr_t = qr_t.to(tl.float16)
            qc_lo = qc_t
            qr_lo = qr_t
            q_sc = tl.full([BLOCK_H], 1.0, tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_t = tl.zeros([DC, BLOCK_H], tl.float32)
        kv_len = tl.load(KVLEN + req)
        per = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = s * per
        hi = tl.minimum(lo + per, kv_len)
        full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        bt_row = BT + req.to(tl.int64) * stride_bt
        if PREFETCH:
            # registers as the second buffer: tile i + 1 is loaded (plain loads, in flight)
            # before tile i is attended; Triton's own pipelining (num_stages) is off here
            kc, kr, kw = _load_tile(lo, hi, C, bt_row, stride_cp, RANK, ROPE, DC, DR, SLAB,
                                    PAGE, BLOCK_N, True, PAIRS, QFP8)
            for n0 in range(lo, hi, BLOCK_N):
                s_t, kv = _tile_logits(kc, kr, kw, qc_t, qr_t, qc_lo, qr_lo, q_sc, qk_scale,
                                       PAIRS, E5M2, ASM, QFP8)
                # the logits MMAs have taken this tile: the next one goes in flight now
                kc, kr, kw = _load_tile(n0 + BLOCK_N, hi, C, bt_row, stride_cp, RANK, ROPE, DC,
                                        DR, SLAB, PAGE, BLOCK_N, True, PAIRS, QFP8)
                acc_t, m_i, l_i = _tile_softmax_pv(acc_t, m_i, l_i, s_t, kv, n0, hi, BLOCK_N,
                                                   True)
        elif HOIST > 0:
            # the page ids of CHUNK tokens loaded at once, then a loop of tiles whose addresses
            # are arithmetic on them: Triton's pipelining (num_stages) can issue those loads
            # stages ahead (a page-id load inside the loop leaves the data one tile ahead)
            jp = tl.arange(0, MAXP_POW2)  # >= the pages a chunk of HOIST tiles can touch
            for c0 in range(lo, hi, HOIST * BLOCK_N):
                page0 = c0 // PAGE
                c_end = tl.minimum(c0 + HOIST * BLOCK_N, hi)
                pages = tl.load(bt_row + page0 + jp, mask=(page0 + jp) * PAGE < c_end, other=0)
                for n0 in range(c0, c_end, BLOCK_N):
                    kc, kr, kw = _load_tile(n0, c_end, C, bt_row, stride_cp, RANK, ROPE, DC, DR,
                                            SLAB, PAGE, BLOCK_N, True, PAIRS, QFP8, pages,
                                            page0, MAXP_POW2)
                    acc_t, m_i, l_i = _attend_tile(acc_t, m_i, l_i, kc, kr, kw, qc_t, qr_t,
                                                   qc_lo, qr_lo, q_sc, n0, c_end, qk_scale,
                                                   BLOCK_N, True, PAIRS, E5M2, ASM, QFP8)
        else:
            for n0 in range(lo, full_end, BLOCK_N):
                acc_t, m_i, l_i = _swap_tile(acc_t, m_i, l_i, qc_t, qr_t, qc_lo, qr_lo, q_sc,
                                             n0, hi, C, bt_row, stride_cp, qk_scale, RANK, ROPE,
                                             DC, DR, SLAB, PAGE, BLOCK_N, False, PAIRS, E5M2,
                                             ASM, QFP8)
            for n0 in range(full_end, hi, BLOCK_N):
                acc_t, m_i, l_i = _swap_tile(acc_t, m_i, l_i, qc_t, qr_t, qc_lo, qr_lo, q_sc,
                                             n0, hi, C, bt_row, stride_cp, qk_scale, RANK, ROPE,
                                             DC, DR, SLAB, PAGE, BLOCK_N, True, PAIRS, E5M2,
                                             ASM, QFP8)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o_t = acc_t / safe_l[None, :]  # [DC, BLOCK_H]
        dmask = hlive[None, :] & (dc < RANK)[:, None]
        if SINGLE:
            dst = OUT + req.to(tl.int64) * stride_ot + hq[None, :] * stride_oh + dc[:, None]
            tl.store(dst, (o_t * out_scale).to(OUT.dtype.element_ty), mask=dmask)
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (req.to(tl.int64) * H + hq) * num_splits + s  # [BLOCK_H] scratch rows
            tl.store(OP + row[None, :] * DC + dc[:, None], o_t, mask=dmask)
            tl.store(LSE + row, lse, mask=hlive)

    return _mla_decode_swap
