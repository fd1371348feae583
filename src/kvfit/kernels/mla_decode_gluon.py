"""The MLA decode kernel written in Gluon (Triton's explicit-layout language), for Hopper.

Why Gluon. In Triton's ``tl.dot`` an 8-bit latent tile is converted to 16 bits after each
shared-memory load of each MMA operand (docs/benchmarks.md, MLA section: ~6x the one
conversion a tile needs), so the fp8 swapped kernel of ``mla_decode_kernels`` reads its
latents at ~20% of the copy bandwidth and is slower than the bf16 one. Here the tile's path is
written out, once per element:

    global --cp.async--> stage[i % STAGES] (the bytes as stored, STAGES - 1 tiles in flight)
           --ld.shared, cvt (fp8 -> f16), st.shared--> lat [BLOCK_N, 512 | 64] (NVMMA layout)
    s^T [BLOCK_N, H]  = lat_c . q_c^T + lat_r . q_r^T    (warp-group MMAs from shared memory)
    o^T [512, H]     += lat_c^T . p^T                      (the same buffer, a transposed view)

Heads are the MMAs' N (16 at DeepSeek-V2-Lite), the latent tile their M (64 tokens), as in the
swapped Triton kernel. 16-bit latents skip the conversion: the MMAs read the stage buffer.
The query, in the MMA's 16-bit type (float16 for fp8 latents, whose values it holds exactly),
sits in shared memory for the whole program; p^T passes through a small shared buffer.

Grid ``(batch * HBLK, splits)``, program (request, block of BLOCK_H heads, split); one split
writes ``OUT`` (times the latent scale), several write float32 partials ``OP`` (rows
``(req * H + h) * splits + s``) and base-2 log-sum-exp ``LSE`` for ``decode_kernels``' merge,
as the Triton kernels do. Page ids of the next tile are loaded one iteration before their
copies are issued. Owns nothing; writes ``OUT`` or ``OP``/``LSE``.
"""

from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90+)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names())

    @gluon.jit
    def _page_ids(bt_row, n0, hi, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, L: gl.constexpr):
        # page id of each token of [n0, n0 + BLOCK_N) in the row layout of L (0 past hi)
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        return gl.load(bt_row + n // PAGE, mask=n < hi, other=0)

    @gluon.jit
    def _issue(dst, C, pages, n0, hi, col0, stride_cp, WIDTH: gl.constexpr, SLAB: gl.constexpr,
               PAGE: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr):
        # cp.async of columns [col0, col0 + WIDTH) of tokens [n0, n0 + BLOCK_N) into dst
        # [BLOCK_N, WIDTH]; tokens >= hi are zero-filled (never read from memory)
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
        row = pages.to(gl.int64) * stride_cp + (n % PAGE) * SLAB + col0  # [BLOCK_N]
        ptr = C + row[:, None] + d[None, :]
        _cp_async(dst, ptr, mask=(n < hi)[:, None])  # noqa: F821

    @gluon.jit
    def _issue_tile(stage_c, stage_r, C, pg_c, pg_r, n0, hi, stride_cp, RANK: gl.constexpr,
                    ROPE: gl.constexpr, SLAB: gl.constexpr, PAGE: gl.constexpr,
                    BLOCK_N: gl.constexpr, LC: gl.constexpr, LR: gl.constexpr):
        # one commit group of cp.async for tokens [n0, n0 + BLOCK_N): the latent columns into
        # stage_c, the rope columns into stage_r (their page ids pg_c, pg_r in LC's, LR's rows)
        _issue(stage_c, C, pg_c, n0, hi, 0, stride_cp, RANK, SLAB, PAGE, BLOCK_N, LC)
        _issue(stage_r, C, pg_r, n0, hi, RANK, stride_cp, ROPE, SLAB, PAGE, BLOCK_N, LR)
        async_copy.commit_group()

    @gluon.jit
    def _fp8_logits(stage_c, stage_r, qh_c, qh_r, ql_c, ql_r, s_zero):
        # a stage's logits against the query's two e4m3 parts by fp8 MMAs, issued, not waited
        # for: the (hi, lo) accumulators in flight (logits = hi + lo / 16, times q_sc)
        s_hi = warpgroup_mma(stage_c, qh_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_hi = warpgroup_mma(stage_r, qh_r.permute((1, 0)), s_hi, is_async=True)
        s_lo = warpgroup_mma(stage_c, ql_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_lo = warpgroup_mma(stage_r, ql_r.permute((1, 0)), s_lo, is_async=True)
        return s_hi, s_lo

    @gluon.jit
    def _split_query(qc, qr, qh_c, qh_r, ql_c, ql_r, F8: gl.constexpr):
        # per head (rows of qc [BLOCK_H, RANK], qr [BLOCK_H, ROPE], float32): q / q_sc = hi +
        # lo / 16 in e4m3 (~8 significant bits, as bfloat16) into the four shared buffers,
        # q_sc = amax / 448 (max(., 1e-30) keeps an all-zero head finite); returns q_sc
        amax = gl.maximum(gl.max(gl.abs(qc), axis=1), gl.max(gl.abs(qr), axis=1))
        q_sc = gl.maximum(amax, 1e-30) / 448.0  # [BLOCK_H]
        qc = qc / q_sc[:, None]
        qr = qr / q_sc[:, None]
        hc = qc.to(F8)
        hr = qr.to(F8)
        qh_c.store(hc)
        qh_r.store(hr)
        ql_c.store(((qc - hc.to(gl.float32)) * 16.0).to(F8))
        ql_r.store(((qr - hr.to(gl.float32)) * 16.0).to(F8))
        return q_sc

    @gluon.jit
    def _convert_tile(src, dst, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, L: gl.constexpr):
        # the 8-bit tile src [BLOCK_N, W] -> dst (float16, the MMAs' layout), CHUNK rows a step
        for r in gl.static_range(BLOCK_N // CHUNK):
            x = src.slice(r * CHUNK, CHUNK, 0).load(L)
            dst.slice(r * CHUNK, CHUNK, 0).store(x.to(dst.dtype))

    @gluon.jit
    def _scaled_logits(s_t, s_scale, n0, hi, BLOCK_N: gl.constexpr, SM: gl.constexpr):
        # logits s_t [BLOCK_N, H] (layout SM) of tokens [n0, n0 + BLOCK_N) in base 2; tokens
        # >= hi at -inf (weigh 0)
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SM))
        return gl.where((n < hi)[:, None], s_t * s_scale[None, :], float("-inf"))

    @gluon.jit
    def _rescale(s_t, m_i, m_tile):
        # the running maximum m_i [H] raised to the tile's m_tile: (p [BLOCK_N, H], alpha, m)
        m_new = gl.maximum(m_i, m_tile)
        alpha = gl.exp2(m_i - m_new)
        return gl.exp2(s_t - m_new[None, :]), alpha, m_new

    @gluon.jit
    def _softmax_step(s_t, m_i, l_i, s_scale, n0, hi, BLOCK_N: gl.constexpr, SM: gl.constexpr):
        # the tile's logits into the running base-2 softmax down axis 0: (p [BLOCK_N, H],
        # alpha, m, l)
        s_t = _scaled_logits(s_t, s_scale, n0, hi, BLOCK_N, SM)
        p_t, alpha, m_new = _rescale(s_t, m_i, gl.max(s_t, axis=0))
        return p_t, alpha, m_new, l_i * alpha + gl.sum(p_t, axis=0)

    @gluon.jit
    def _split_range(KVLEN, req, s, num_splits, BLOCK_N: gl.constexpr):
        # split s's tokens [lo, hi) of the request (splits of whole BLOCK_N tiles) and its tile
        # count (0 for an empty split)
        kv_len = gl.load(KVLEN + req)
        per = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = s * per
        hi = gl.minimum(lo + per, kv_len)
        return lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    @gluon.jit
    def _write_out(acc, m_i, l_i, OUT, OP, LSE, req, h0, s, num_splits, stride_ot, stride_oh,
                   out_scale, H: gl.constexpr, RANK: gl.constexpr, BLOCK_H: gl.constexpr,
                   SINGLE: gl.constexpr, MMA: gl.constexpr, SM: gl.constexpr,
                   LO: gl.constexpr, D0: gl.constexpr):
        # o^T rows [D0, D0 + W) = acc [W, BLOCK_H] / l (W = RANK: all of them): one split
        # writes OUT (times the latent scale), several the float32 partial rows (req * H + h) *
        # splits + s of OP and (with row 0) their base-2 LSE
        W: gl.constexpr = acc.shape[0]
        safe_l = gl.where(l_i > 0, l_i, 1.0)
        o_t = acc / gl.convert_layout(safe_l, gl.SliceLayout(0, MMA))[None, :]
        o_t = gl.convert_layout(o_t, LO)  # [W, BLOCK_H]
        d = D0 + gl.arange(0, W, layout=gl.SliceLayout(1, LO))
        ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LO))
        omask = (ho < H)[None, :] & (d < RANK)[:, None]
        if SINGLE:
            dst = OUT + req.to(gl.int64) * stride_ot + ho[None, :] * stride_oh + d[:, None]
            gl.store(dst, (o_t * out_scale).to(OUT.dtype.element_ty), mask=omask)
        else:
            row = (req.to(gl.int64) * H + ho) * num_splits + s  # [BLOCK_H] scratch rows
            gl.store(OP + row[None, :] * RANK + d[:, None], o_t, mask=omask)
            if D0 == 0:
                lse = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
                hl = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, SM))
                gl.store(LSE + (req.to(gl.int64) * H + hl) * num_splits + s, lse, mask=hl < H)

    # shared with mla_decode_fp8_pipe and mla_decode_fp8_regs
    globals().update(_page_ids=_page_ids, _issue_tile=_issue_tile, _fp8_logits=_fp8_logits,
                     _split_query=_split_query, _convert_tile=_convert_tile,
                     _scaled_logits=_scaled_logits, _rescale=_rescale,
                     _softmax_step=_softmax_step, _write_out=_write_out,
                     _split_range=_split_range)

    @gluon.jit
    def _mla_decode_gluon(Q, C, BT, KVLEN, OUT, OP, LSE, qk_scale, out_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
                          num_splits,
                          H: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr,
                          SLAB: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
                          BLOCK_N: gl.constexpr, HBLK: gl.constexpr, STAGES: gl.constexpr,
                          CHUNK: gl.constexpr, SINGLE: gl.constexpr, CONVERT: gl.constexpr,
                          QFP8: gl.constexpr, XV: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(CONVERT or not QFP8, "fp8 logits read an 8-bit cache")
        pid = gl.program_id(0)
        s = gl.program_id(1)
        req = pid // HBLK
        h0 = (pid % HBLK) * BLOCK_H
        KV_T: gl.constexpr = C.dtype.element_ty
        MMA_T: gl.constexpr = gl.float16 if CONVERT else KV_T
        # layouts: the MMAs' accumulators ([rows, BLOCK_H], rows over the 4 warps; MMA8 for
        # the fp8 logits, k = 32); the copies and conversions move 16 bytes a thread along a
        # slab row
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        MMA8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 32])
        SM: gl.constexpr = MMA8 if QFP8 else MMA  # the logits' and softmax's layout
        VEC: gl.constexpr = 128 // KV_T.primitive_bitwidth  # 16 bytes
        LC: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [4, 1], [1, 0])
        # the conversion's layout, XV elements a thread. 16: 4 rows x 128 columns a warp
        # (measured 1-2% faster than LC, whose stores ncu found with 44% extra wavefronts);
        # Gluon's bank_conflicts counts one extra access per wavefront for both on the float16
        # stores, none for XV = 8 ([1, 8] x [1, 32]): the default, measured 1.10-1.13x XV = 16
        # on the H200 (docs/kernels.md)
        LX: gl.constexpr = (gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]) if XV == 16
                            else gl.BlockedLayout([1, XV], [1, 32], [4, 1], [1, 0]))
        LR: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // ROPE, ROPE // VEC],
                                            [4, 1], [1, 0])
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        # the stages hold the tile as stored: in the MMAs' layout when an MMA reads them
        # (16-bit latents; fp8 logits), else plain rows for the conversion
        Q_T: gl.constexpr = KV_T if QFP8 else MMA_T
        if QFP8 or not CONVERT:
            stage_c = gl.allocate_shared_memory(
                KV_T, [STAGES, BLOCK_N, RANK],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], KV_T))
            stage_r = gl.allocate_shared_memory(
                KV_T, [STAGES, BLOCK_N, ROPE],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], KV_T))
        else:
            stage_c = gl.allocate_shared_memory(KV_T, [STAGES, BLOCK_N, RANK], RAW)
            stage_r = gl.allocate_shared_memory(KV_T, [STAGES, BLOCK_N, ROPE], RAW)
        if CONVERT:
            lat_c = gl.allocate_shared_memory(
                MMA_T, [BLOCK_N, RANK], gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], MMA_T))
        if CONVERT and not QFP8:
            lat_r = gl.allocate_shared_memory(
                MMA_T, [BLOCK_N, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], MMA_T))
        q_c = gl.allocate_shared_memory(
            Q_T, [BLOCK_H, RANK], gl.NVMMASharedLayout.get_default_for([BLOCK_H, RANK], Q_T))
        q_r = gl.allocate_shared_memory(
            Q_T, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], Q_T))
        p_s = gl.allocate_shared_memory(
            MMA_T, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H],
                                                                             MMA_T))

        # the query block [BLOCK_H, RANK | ROPE] into shared memory, in the MMAs' type
        hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        q_row = Q + req.to(gl.int64) * stride_qt + hq * stride_qh
        dq = gl.arange(0, RANK, layout=gl.SliceLayout(0, LQ))
        dqr = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LQ))
        qc = gl.load(q_row[:, None] + dq[None, :], mask=(hq < H)[:, None], other=0.0)
        qr = gl.load(q_row[:, None] + RANK + dqr[None, :], mask=(hq < H)[:, None], other=0.0)
        if QFP8:
            # the logits are (hi . c + (lo . c) / 16) * q_sc: two fp8 MMAs over the stored bytes
            ql_c = gl.allocate_shared_memory(KV_T, [BLOCK_H, RANK], q_c.layout)
            ql_r = gl.allocate_shared_memory(KV_T, [BLOCK_H, ROPE], q_r.layout)
            q_sc = _split_query(qc.to(gl.float32), qr.to(gl.float32), q_c, q_r, ql_c, ql_r, KV_T)
            s_scale = gl.convert_layout(q_sc, gl.SliceLayout(0, SM)) * qk_scale
        else:
            q_c.store(qc.to(MMA_T))
            q_r.store(qr.to(MMA_T))
            s_scale = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(0, SM)) * qk_scale

        lo, hi, n_tiles = _split_range(KVLEN, req, s, num_splits, BLOCK_N)
        bt_row = BT + req.to(gl.int64) * stride_bt

        # prologue: STAGES - 1 tiles in flight (tiles past hi copy nothing)
        for t in gl.static_range(STAGES - 1):
            n0 = lo + t * BLOCK_N
            _issue_tile(stage_c.index(t), stage_r.index(t), C,
                        _page_ids(bt_row, n0, hi, BLOCK_N, PAGE, LC),
                        _page_ids(bt_row, n0, hi, BLOCK_N, PAGE, LR), n0, hi, stride_cp, RANK,
                        ROPE, SLAB, PAGE, BLOCK_N, LC, LR)
        nxt = lo + (STAGES - 1) * BLOCK_N
        pg_c = _page_ids(bt_row, nxt, hi, BLOCK_N, PAGE, LC)
        pg_r = _page_ids(bt_row, nxt, hi, BLOCK_N, PAGE, LR)

        fence_async_shared()
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, SM))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, SM))
        acc = gl.zeros([RANK, BLOCK_H], gl.float32, layout=MMA)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=SM)
        for i in range(n_tiles):
            # the copies of tile i + STAGES - 1 (page ids loaded an iteration ago) go in flight
            j = i + STAGES - 1
            nj = lo + j * BLOCK_N
            _cta_barrier()  # noqa: F821 -- every thread is done with the stage overwritten
            _issue_tile(stage_c.index(j % STAGES), stage_r.index(j % STAGES), C, pg_c, pg_r, nj,
                        hi, stride_cp, RANK, ROPE, SLAB, PAGE, BLOCK_N, LC, LR)
            pg_c = _page_ids(bt_row, nj + BLOCK_N, hi, BLOCK_N, PAGE, LC)
            pg_r = _page_ids(bt_row, nj + BLOCK_N, hi, BLOCK_N, PAGE, LR)
            async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
            fence_async_shared()  # (the MMAs read them through the async proxy)
            _cta_barrier()  # noqa: F821 -- and every thread's
            cur = i % STAGES
            if QFP8:
                # the logits from the stored bytes (fp8 MMAs, in flight) while the tile's
                # 512 latent columns become float16 in shared memory for P . latent
                a_c = lat_c
                s_hi, s_lo = _fp8_logits(stage_c.index(cur), stage_r.index(cur), q_c, q_r, ql_c,
                                         ql_r, s_zero)
                _convert_tile(stage_c.index(cur), lat_c, BLOCK_N, CHUNK, LX)
                fence_async_shared()
                s_hi, s_lo = warpgroup_mma_wait(num_outstanding=0, deps=(s_hi, s_lo))
                s_t = s_hi + s_lo * 0.0625
            else:
                if CONVERT:
                    # the 8-bit tile becomes float16 once, in shared memory, for both products
                    _convert_tile(stage_c.index(cur), lat_c, BLOCK_N, CHUNK, LX)
                    lat_r.store(stage_r.index(cur).load(LR).to(MMA_T))
                    fence_async_shared()
                    _cta_barrier()  # noqa: F821
                    a_c = lat_c
                    a_r = lat_r
                else:
                    a_c = stage_c.index(cur)
                    a_r = stage_r.index(cur)
                s_t = warpgroup_mma(a_c, q_c.permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
                s_t = warpgroup_mma(a_r, q_r.permute((1, 0)), s_t, is_async=True)
                s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            p_t, alpha, m_i, l_i = _softmax_step(s_t, m_i, l_i, s_scale, lo + i * BLOCK_N, hi,
                                                 BLOCK_N, SM)
            p_s.store(p_t.to(MMA_T))
            fence_async_shared()
            _cta_barrier()  # noqa: F821
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
            acc = warpgroup_mma(a_c.permute((1, 0)), p_s, acc * alpha_o[None, :], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        async_copy.wait_group(0)

        _write_out(acc, m_i, l_i, OUT, OP, LSE, req, h0, s, num_splits, stride_ot, stride_oh,
                   out_scale, H, RANK, BLOCK_H, SINGLE, MMA, SM, LO, 0)

    return _mla_decode_gluon
