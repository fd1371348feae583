"""The e4m3 MLA decode kernel in Gluon with the next tile's work under this tile's: the logits of
tile i + 1 and its conversion run while tile i's softmax and P . latent do (Hopper).

Why. ``mla_decode_gluon`` runs each 64-token tile's chain in order on one warp group (copy
wait, conversion, 68 MMAs of N = 16, the softmax's cross-warp reductions): ~3.1 us an SM per
fp8 tile, where its 36.9 KB take ~1.25 us at the copy bandwidth (docs/benchmarks.md, "MLA
decode in Gluon"). Here the logits come from the stored bytes (fp8 MMAs against the query split
as hi + lo / 16 in e4m3, as that kernel's ``qfp8``), so tile i + 1's logits need no conversion
and are issued before tile i's softmax; tile i + 1's 512 latent columns are converted to
float16 into the second of two buffers while tile i's P . latent reads the first:

    iteration i:  wait copy (i + 1) | issue S(i + 1) (fp8 MMAs, stage)      -> tensor cores
                  softmax(i) on S(i), p -> shared                             (under S(i + 1))
                  issue O(i) += lat[i % 2]^T . p^T                            -> tensor cores
                  convert stage (i + 1) -> lat[(i + 1) % 2]                   (under S(i + 1), O(i))
                  wait both; copy (i + 3) -> the stage tile i + 1 used

Two stages of 36.9 KB (one tile in flight beyond the next), two 64-KB float16 tiles, the query's
two e4m3 parts: 222 KB of shared memory, one program per SM. Grid, outputs, split scratch and
merge as ``mla_decode_gluon`` (``kernels.mla`` launches it for ``MLAConfig(pipe=True)``). Owns
nothing; writes ``OUT`` or ``OP``/``LSE``.
"""

from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted kernel, built once per process on first use (CUDA, sm_90+)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kvfit.kernels import mla_decode_gluon

    mla_decode_gluon.build()
    for name in ("_page_ids", "_issue_tile", "_fp8_logits", "_split_query", "_convert_tile",
                 "_softmax_step", "_write_out", "_split_range", "_cta_barrier", "gl",
                 "async_copy", "fence_async_shared", "warpgroup_mma", "warpgroup_mma_wait"):
        globals()[name] = getattr(mla_decode_gluon, name)

    @gluon.jit
    def _mla_decode_fp8_pipe(Q, C, BT, KVLEN, OUT, OP, LSE, qk_scale, out_scale,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
                             num_splits,
                             H: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr,
                             SLAB: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
                             BLOCK_N: gl.constexpr, HBLK: gl.constexpr, CHUNK: gl.constexpr,
                             SINGLE: gl.constexpr, XV: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        pid = gl.program_id(0)
        s = gl.program_id(1)
        req = pid // HBLK
        h0 = (pid % HBLK) * BLOCK_H
        F8: gl.constexpr = C.dtype.element_ty
        F16: gl.constexpr = gl.float16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        MMA8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 32])
        LC: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
        LX: gl.constexpr = (gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]) if XV == 16
                            else gl.BlockedLayout([1, XV], [1, 32], [4, 1], [1, 0]))  # as there
        LR: gl.constexpr = gl.BlockedLayout([1, 16], [512 // ROPE, ROPE // 16], [4, 1], [1, 0])
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        stage_c = gl.allocate_shared_memory(
            F8, [2, BLOCK_N, RANK], gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], F8))
        stage_r = gl.allocate_shared_memory(
            F8, [2, BLOCK_N, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], F8))
        lat = gl.allocate_shared_memory(
            F16, [2, BLOCK_N, RANK], gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], F16))
        qh_c = gl.allocate_shared_memory(
            F8, [BLOCK_H, RANK], gl.NVMMASharedLayout.get_default_for([BLOCK_H, RANK], F8))
        ql_c = gl.allocate_shared_memory(F8, [BLOCK_H, RANK], qh_c.layout)
        qh_r = gl.allocate_shared_memory(
            F8, [BLOCK_H, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], F8))
        ql_r = gl.allocate_shared_memory(F8, [BLOCK_H, ROPE], qh_r.layout)
        p_s = gl.allocate_shared_memory(
            F16, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], F16))

        # the query block: per head q / q_sc = hi + lo / 16 in e4m3, q_sc = amax / 448
        hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        q_row = Q + req.to(gl.int64) * stride_qt + hq * stride_qh
        dq = gl.arange(0, RANK, layout=gl.SliceLayout(0, LQ))
        dqr = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LQ))
        qc = gl.load(q_row[:, None] + dq[None, :], mask=(hq < H)[:, None],
                     other=0.0).to(gl.float32)
        qr = gl.load(q_row[:, None] + RANK + dqr[None, :], mask=(hq < H)[:, None],
                     other=0.0).to(gl.float32)
        q_sc = _split_query(qc, qr, qh_c, qh_r, ql_c, ql_r, F8)  # noqa: F821
        s_scale = gl.convert_layout(q_sc, gl.SliceLayout(0, MMA8)) * qk_scale

        lo, hi, n_tiles = _split_range(KVLEN, req, s, num_splits, BLOCK_N)  # noqa: F821
        bt_row = BT + req.to(gl.int64) * stride_bt
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=MMA8)

        # prologue: tiles 0 and 1 in flight; tile 0's logits and conversion; tile 2 in flight
        for t in gl.static_range(2):
            n0 = lo + t * BLOCK_N
            _issue_tile(stage_c.index(t), stage_r.index(t), C,  # noqa: F821
                        _page_ids(bt_row, n0, hi, BLOCK_N, PAGE, LC),  # noqa: F821
                        _page_ids(bt_row, n0, hi, BLOCK_N, PAGE, LR), n0, hi,  # noqa: F821
                        stride_cp, RANK, ROPE, SLAB, PAGE, BLOCK_N, LC, LR)
        async_copy.wait_group(1)  # noqa: F821
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821
        s_hi, s_lo = _fp8_logits(stage_c.index(0), stage_r.index(0), qh_c, qh_r, ql_c,  # noqa: F821
                                 ql_r, s_zero)
        _convert_tile(stage_c.index(0), lat.index(0), BLOCK_N, CHUNK, LX)  # noqa: F821
        fence_async_shared()  # noqa: F821
        s_hi, s_lo = warpgroup_mma_wait(num_outstanding=0, deps=(s_hi, s_lo))  # noqa: F821
        s_cur = s_hi + s_lo * 0.0625
        _cta_barrier()  # noqa: F821 -- stage 0 is free
        n2 = lo + 2 * BLOCK_N
        _issue_tile(stage_c.index(0), stage_r.index(0), C,  # noqa: F821
                    _page_ids(bt_row, n2, hi, BLOCK_N, PAGE, LC),  # noqa: F821
                    _page_ids(bt_row, n2, hi, BLOCK_N, PAGE, LR), n2, hi,  # noqa: F821
                    stride_cp, RANK, ROPE, SLAB, PAGE, BLOCK_N, LC, LR)
        pg_c = _page_ids(bt_row, n2 + BLOCK_N, hi, BLOCK_N, PAGE, LC)  # noqa: F821
        pg_r = _page_ids(bt_row, n2 + BLOCK_N, hi, BLOCK_N, PAGE, LR)  # noqa: F821

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA8))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, MMA8))
        acc = gl.zeros([RANK, BLOCK_H], gl.float32, layout=MMA)
        for i in range(n_tiles):
            cb = i % 2
            nb = 1 - cb
            # tile i + 1 has landed (tile i + 2 may still be in flight)
            async_copy.wait_group(1)  # noqa: F821
            fence_async_shared()  # noqa: F821
            _cta_barrier()  # noqa: F821
            n_hi, n_lo = _fp8_logits(stage_c.index(nb), stage_r.index(nb), qh_c, qh_r, ql_c,  # noqa: F821
                                     ql_r, s_zero)
            # tile i's online softmax down the token axis (axis 0), base 2
            p_t, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, s_scale, lo + i * BLOCK_N,  # noqa: F821
                                                 hi, BLOCK_N, MMA8)
            p_s.store(p_t.to(F16))
            fence_async_shared()  # noqa: F821
            _cta_barrier()  # noqa: F821
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
            acc = warpgroup_mma(lat.index(cb).permute((1, 0)), p_s, acc * alpha_o[None, :],  # noqa: F821
                                is_async=True)
            # tile i + 1's latent columns into the other float16 buffer, under the MMAs
            _convert_tile(stage_c.index(nb), lat.index(nb), BLOCK_N, CHUNK, LX)  # noqa: F821
            fence_async_shared()  # noqa: F821
            n_hi, n_lo, acc = warpgroup_mma_wait(num_outstanding=0, deps=(n_hi, n_lo, acc))  # noqa: F821
            s_cur = n_hi + n_lo * 0.0625
            _cta_barrier()  # noqa: F821 -- tile i + 1's stage, p and lat[cb] are free
            nj = lo + (i + 3) * BLOCK_N
            _issue_tile(stage_c.index(nb), stage_r.index(nb), C, pg_c, pg_r, nj, hi,  # noqa: F821
                        stride_cp, RANK, ROPE, SLAB, PAGE, BLOCK_N, LC, LR)
            pg_c = _page_ids(bt_row, nj + BLOCK_N, hi, BLOCK_N, PAGE, LC)  # noqa: F821
            pg_r = _page_ids(bt_row, nj + BLOCK_N, hi, BLOCK_N, PAGE, LR)  # noqa: F821
        async_copy.wait_group(0)  # noqa: F821

        _write_out(acc, m_i, l_i, OUT, OP, LSE, req, h0, s, num_splits, stride_ot, stride_oh,  # noqa: F821
                   out_scale, H, RANK, BLOCK_H, SINGLE, MMA, MMA8, LO, 0)

    return _mla_decode_fp8_pipe
