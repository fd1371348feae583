"""The 8-bit MLA decode in Gluon with the logits' A operand from registers (Hopper): the tile's
latent bytes go from global memory straight into the registers of the warp-group MMA's A
operand, are converted to float16 there, feed the logits, and only the 512 value columns are
written to shared memory (once) for P . latent.

Why. The shared-memory kernels (``mla_decode_gluon``, ``mla_decode_fp8_pipe``) move each
64-token fp8 tile through shared memory ~7 times (the cp.async stage written, read by the
conversion and by the logits' MMAs, the float16 tile written and read by P . latent): ~270 KB
of shared-memory traffic per 36.9-KB tile, as much time at 128 B a clock as the tile's bytes at
the copy bandwidth, on one warp group an SM (222 KB of shared memory). Here a tile costs the
float16 tile's write and read and the query's reads (~150 KB), and a program takes 84 KB, so
two run on an SM. What bounds it (ncu source counters, docs/benchmarks.md): not the MMAs but
the latency of each tile's chain, above all the softmax maximum's exchange across the four
warps (shuffles that queued behind the tile's 18 loads a warp, then shared memory and
barriers); the twenty-third session's changes (one barrier for the maximum, the running sum
reduced once after the loop, the loads placed after the exchange, block-table entries a tile
ahead) made it the default for both 8-bit formats. At small batches (a few tiles a program)
a launch's fixed cost weighs: the query's prologue (below) was cut in the twenty-fourth session.

Per tile of 64 tokens (the logits MMAs' M; heads are N, 16 a program):

    chunk j (0..8) of the tile, in registers since the tile before: cvt to float16; columns
        64 j .. 64 j + 63 < 512 stored to their own shared buffer ``lat_j`` [64, 64] (NVMMA
        layout; one buffer per chunk, so the stores need no barrier between them); the same
        registers relabelled (``_hw_k``: nothing moves) are the A operand of s^T += chunk_j .
        q_j^T (warp-group MMA, the query in shared memory in that k order), one chunk's MMAs
        in flight while the next converts
    softmax down the tokens: each warp's maximum of its 16 rows by shuffles, exchanged through
        shared memory with one barrier (``_tile_max``); the running sum kept per row
    global --ld.global.v4--> registers, the next tile: a thread's rows r, r + 8 of its warp's
        16 tokens, 16 contiguous bytes of each 64-column chunk (a whole tile of loads in
        flight during this tile's P . latent and the next tile's first chunks)
    p^T -> shared; o_j^T += lat_j^T . p^T for the eight column blocks (warp-group MMAs from
        shared memory, eight [64, 16] accumulators)

Tokens past the split's end are read as its last token (no predicated loads, never a NaN of
an unused slot) and weigh 0. ``L2_AHEAD`` > 0: tile i also asks L2 for the slabs of tile
i + L2_AHEAD (``_l2_ask``; nothing waits for it). Grid, outputs, split scratch and merge as
``mla_decode_gluon`` (``kernels.mla`` launches it for ``MLAConfig(regs=True)``). Owns nothing;
writes ``OUT`` or ``OP``/``LSE``.
"""

from __future__ import annotations

import functools

# one 32-bit word of four 8-bit latents ($4, columns 4w..4w+3) -> their float16 values $0..$3
# (the hardware conversion of a byte pair into a float16 pair, exact for both fp8 formats)
_WORD_ASM = ("{{\n.reg .b16 lo, hi;\n.reg .b32 a, b;\nmov.b32 {{lo, hi}}, $4;\n"
             "cvt.rn.f16x2.{fmt}x2 a, lo;\ncvt.rn.f16x2.{fmt}x2 b, hi;\n"
             "mov.b32 {{$0, $1}}, a;\nmov.b32 {{$2, $3}}, b;\n}}\n")
WORD_ASM = {"e4m3": _WORD_ASM.format(fmt="e4m3"), "e5m2": _WORD_ASM.format(fmt="e5m2")}


@functools.lru_cache(maxsize=None)
def layouts(block_h: int = 16):
    """(MMA, LW, LA) for ``block_h`` heads: the MMAs' accumulator layout (rows over the 4
    warps); LW ``[64 tokens, 16 words]``, a chunk's 64 columns as loaded, 32-bit words of four
    latents (a thread: rows 16 w + l and 16 w + l + 8 of its lane row l, the 4 contiguous words
    4 c of its lane column c, i.e. columns 16 c .. 16 c + 15); LA the float16 A operand
    (k_width 2), which the converted chunk becomes after ``_hw_k`` without moving a value."""
    from triton.experimental.gluon import language as gl

    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, block_h, 16])
    lw = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    return mma, lw, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)


@functools.cache
def build():
    """The jitted kernel, built once per process on first use (CUDA, sm_90+)."""
    from triton.experimental import gluon

    from kvfit.kernels import mla_decode_gluon
    from kvfit.kernels.gluon_hopper import mha_decode_parts

    mla_decode_gluon.build()
    for name in ("_scaled_logits", "_rescale", "_write_out", "_split_range", "_cta_barrier", "gl",
                 "fence_async_shared", "warpgroup_mma", "warpgroup_mma_wait"):
        globals()[name] = getattr(mla_decode_gluon, name)
    for name in ("_k_order", "_hw_k", "_tile_max", "_l2_prefetch"):
        globals()[name] = mha_decode_parts()[name]

    @gluon.jit
    def _tokens(n0, hi, LW: gl.constexpr):
        # tokens [n0, n0 + 64) in LW's rows; tokens past hi read as token hi - 1 (an empty
        # request reads page 0: memory of the pool, never used)
        return gl.maximum(gl.minimum(n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LW)),
                                     hi - 1), 0)

    @gluon.jit
    def _pages(bt_row, n0, hi, PAGE: gl.constexpr, LW: gl.constexpr):
        # the block-table entries of tokens [n0, n0 + 64) (issued a tile before their use)
        n = _tokens(n0, hi, LW)
        return gl.load(bt_row + n // PAGE, mask=n < hi, other=0)

    @gluon.jit
    def _rows(pg, n0, hi, stride_cp, SLAB: gl.constexpr, PAGE: gl.constexpr,
              LW: gl.constexpr):
        # word offsets of the slabs of tokens [n0, n0 + 64) on their pages pg
        n = _tokens(n0, hi, LW)
        return (pg.to(gl.int64) * stride_cp + (n % PAGE) * SLAB) // 4

    @gluon.jit
    def _l2_ask(C, bt_row, n0, hi, stride_cp, SLAB: gl.constexpr, PAGE: gl.constexpr):
        # ask L2 for the slabs of tokens [n0, n0 + 64) (fire and forget: no register waits for
        # it), so that their loads, tiles later, find the lines in L2, not DRAM; tokens past hi
        # ask for token hi - 1's again (as _tokens reads them). A thread a token, its slab's
        # lines at bytes 0, 128, .. and its last byte ([64, 8]: two threads a token, four
        # addresses each; SLAB <= 7 x 128 + 1)
        LP: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])
        t = _tokens(n0, hi, LP)
        k = gl.arange(0, 8, layout=gl.SliceLayout(0, LP))
        pg = gl.load(bt_row + t // PAGE).to(gl.int64)
        row = C.to(gl.int64) + pg * stride_cp + (t % PAGE) * SLAB  # the slab's byte address
        _l2_prefetch(row[:, None] + gl.minimum(k * 128, SLAB - 1)[None, :])  # noqa: F821

    @gluon.jit
    def _chunk(Cw, rows, J: gl.constexpr, LW: gl.constexpr):
        # columns [64 J, 64 J + 64) of the rows as 32-bit words [64, 16]: 16 contiguous bytes
        # of two rows a thread (words, not bytes, are carried across the loop: one register
        # each, where a byte tensor would take one register a byte)
        w = 16 * J + gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
        return gl.load(Cw + rows[:, None] + w[None, :])

    @gluon.jit
    def _chunks(Cw, rows, LW: gl.constexpr):
        # the nine chunks of the rows' slabs (512 latent + 64 rope columns)
        return (_chunk(Cw, rows, 0, LW), _chunk(Cw, rows, 1, LW), _chunk(Cw, rows, 2, LW),
                _chunk(Cw, rows, 3, LW), _chunk(Cw, rows, 4, LW), _chunk(Cw, rows, 5, LW),
                _chunk(Cw, rows, 6, LW), _chunk(Cw, rows, 7, LW), _chunk(Cw, rows, 8, LW))

    @gluon.jit
    def _query_chunk(q_row, hq, col, J: gl.constexpr, H: gl.constexpr, BLOCK_H: gl.constexpr):
        # query columns 64 J .. 64 J + 63 of the block's heads (heads past H read as 0), loaded
        # in column order (16-byte loads) and relabelled into the A operand's k order as _hw_k
        # relabels the latent chunk (nothing moves: the store to shared memory writes each
        # value at its k)
        x = gl.load(q_row[:, None] + (64 * J + col)[None, :], mask=(hq < H)[:, None], other=0.0)
        return _k_order(x, BLOCK_H, 64)  # noqa: F821

    @gluon.jit
    def _query(q_row, hq, col, H: gl.constexpr, BLOCK_H: gl.constexpr):
        # the query's nine chunks (8: the rope columns), loads issued, nothing waited for
        return (_query_chunk(q_row, hq, col, 0, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 1, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 2, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 3, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 4, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 5, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 6, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 7, H, BLOCK_H),
                _query_chunk(q_row, hq, col, 8, H, BLOCK_H))

    @gluon.jit
    def _to_f16(x, ASM: gl.constexpr):
        # words [64, 16] -> float16 [64, 64], column 4 w + e from byte e of word w
        o = gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,r", [x], dtype=(gl.float16,) * 4,
                                      is_pure=True, pack=1)
        y = gl.join(gl.join(o[0], o[2]), gl.join(o[1], o[3]))  # [64, 16, e1, e0]
        return gl.reshape(y, [64, 64])

    @gluon.jit
    def _logits_step(x, s_t, a_prev, q_j, lat_j, STORE: gl.constexpr, LA: gl.constexpr,
                     ASM: gl.constexpr):
        # a chunk's words x -> float16 (stored to lat_j when STORE), the A operand of s^T +=
        # x . q_j^T (issued); the previous chunk's MMA waited for (its registers free again)
        f = _to_f16(x, ASM)
        if STORE:
            lat_j.store(f)
        a = _hw_k(f, 64, 64, LA)  # noqa: F821
        s_t = warpgroup_mma(a, q_j.permute((1, 0)), s_t, is_async=True)  # noqa: F821
        s_t, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, a_prev))  # noqa: F821
        return s_t, a

    @gluon.jit
    def _pv(acc, lat_j, p_s, alpha):
        # o_j^T [64, BLOCK_H] = acc * alpha + lat_j^T . p^T, issued (waited for by the caller)
        return warpgroup_mma(lat_j.permute((1, 0)), p_s, acc * alpha[None, :],  # noqa: F821
                             is_async=True)

    @gluon.jit
    def _opaque_zero(i):
        # 0, computed from the loop counter: shared-memory addresses reached through it stay in
        # the loop (hoisted out of it, the 68 MMA descriptors held ~140 registers across it and
        # spilled)
        return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [i], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _mla_decode_fp8_regs(Q, C, BT, KVLEN, OUT, OP, LSE, qk_scale, out_scale,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
                             num_splits,
                             H: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr,
                             SLAB: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
                             BLOCK_N: gl.constexpr, HBLK: gl.constexpr, SINGLE: gl.constexpr,
                             MMA: gl.constexpr, LW: gl.constexpr, LA: gl.constexpr,
                             ASM: gl.constexpr, L2_AHEAD: gl.constexpr,
                             num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(RANK == 512 and ROPE == 64 and BLOCK_N == 64, "DeepSeek's slab")
        pid = gl.program_id(0)
        s = gl.program_id(1)
        req = pid // HBLK
        h0 = (pid % HBLK) * BLOCK_H
        F16: gl.constexpr = gl.float16
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        # the latent's eight column blocks (float16, [1, 64, 64] each: index 0 is reached
        # through _opaque_zero in the loop), the query's nine (8 + rope) and P
        LL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], F16)
        c0 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c1 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c2 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c3 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c4 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c5 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c6 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        c7 = gl.allocate_shared_memory(F16, [1, BLOCK_N, 64], LL)
        QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], F16)
        q_c = gl.allocate_shared_memory(F16, [8, BLOCK_H, 64], QL)  # latent columns
        q_r = gl.allocate_shared_memory(F16, [1, BLOCK_H, 64], QL)  # rope columns
        mx_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        p_s = gl.allocate_shared_memory(
            F16, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H],
                                                                           F16))

        # the query block, chunk j's columns in the A operand's hardware k order: k = 16 ks +
        # 8 b3 + 2 c + b0 holds column 64 j + 16 c + 4 ks + 2 b3 + b0 (_hw_k's relabelling).
        # Its nine chunks are loaded first (9 16-byte loads a thread) and stored after tile 0's
        # loads are issued, so their round trip overlaps the chain split bounds -> tile 0's
        # pages -> tile 0's loads. Loaded by the permuted column (144 2-byte loads a thread) and
        # stored chunk by chunk, each store's barrier waiting for its loads, the prologue took
        # ~17% of a 4 x 32k call's warp samples; this order and these loads made the kernel 10%
        # faster at 4 x 16k and 6.5% at 4 x 32k (H100, docs/benchmarks.md, twenty-fourth session)
        hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        q_row = Q + req.to(gl.int64) * stride_qt + hq * stride_qh
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
        qs = _query(q_row, hq, col, H, BLOCK_H)
        s_scale = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(0, MMA)) * qk_scale

        lo, hi, n_tiles = _split_range(KVLEN, req, s, num_splits, BLOCK_N)  # noqa: F821
        bt_row = BT + req.to(gl.int64) * stride_bt
        Cw = C.to(gl.pointer_type(gl.int32), bitcast=True)

        # tile 0's nine chunks into registers
        rows = _rows(_pages(bt_row, lo, hi, PAGE, LW), lo, hi, stride_cp, SLAB, PAGE, LW)
        x0, x1, x2, x3, x4, x5, x6, x7, x8 = _chunks(Cw, rows, LW)
        pg = _pages(bt_row, lo + BLOCK_N, hi, PAGE, LW)  # tile 1's
        for ta in gl.static_range(1, L2_AHEAD):  # tile i + L2_AHEAD is asked of L2 in tile i
            _l2_ask(C, bt_row, lo + ta * BLOCK_N, hi, stride_cp, SLAB, PAGE)
        for j in gl.static_range(8):
            q_c.index(j).store(qs[j].to(F16))
        q_r.index(0).store(qs[8].to(F16))
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821 -- the query is in shared memory

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        # the softmax's running sum, kept per token row (rescaled with the accumulators) and
        # summed down the tokens once after the loop: no reduction across warps per tile
        l_t = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=MMA)
        o0 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)  # o^T's column blocks
        o1 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o2 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o3 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o4 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o5 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o6 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        o7 = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=MMA)
        for i in range(n_tiles):
            n0 = lo + i * BLOCK_N
            z = _opaque_zero(i)
            # the next tile's rows from its pages (loaded a tile ago); the pages of the tile
            # after next issued now: nothing waits for a block-table load
            rows = _rows(pg, n0 + BLOCK_N, hi, stride_cp, SLAB, PAGE, LW)
            pg = _pages(bt_row, n0 + 2 * BLOCK_N, hi, PAGE, LW)
            if L2_AHEAD > 0:
                _l2_ask(C, bt_row, n0 + L2_AHEAD * BLOCK_N, hi, stride_cp, SLAB, PAGE)
            f = _to_f16(x0, ASM)
            c0.index(z).store(f)
            a = _hw_k(f, 64, 64, LA)  # noqa: F821
            s_t = warpgroup_mma(a, q_c.index(z).permute((1, 0)), s_zero, use_acc=False,  # noqa: F821
                                is_async=True)
            s_t, a = _logits_step(x1, s_t, a, q_c.index(z + 1), c1.index(z), True, LA, ASM)
            s_t, a = _logits_step(x2, s_t, a, q_c.index(z + 2), c2.index(z), True, LA, ASM)
            s_t, a = _logits_step(x3, s_t, a, q_c.index(z + 3), c3.index(z), True, LA, ASM)
            s_t, a = _logits_step(x4, s_t, a, q_c.index(z + 4), c4.index(z), True, LA, ASM)
            s_t, a = _logits_step(x5, s_t, a, q_c.index(z + 5), c5.index(z), True, LA, ASM)
            s_t, a = _logits_step(x6, s_t, a, q_c.index(z + 6), c6.index(z), True, LA, ASM)
            s_t, a = _logits_step(x7, s_t, a, q_c.index(z + 7), c7.index(z), True, LA, ASM)
            s_t, a = _logits_step(x8, s_t, a, q_r.index(z), c0, False, LA, ASM)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, a))[0]  # noqa: F821
            # the online softmax down the tokens (axis 0), base 2; then o^T += lat^T . p^T
            s_t = _scaled_logits(s_t, s_scale, n0, hi, BLOCK_N, MMA)  # noqa: F821
            p_t, alpha, m_i = _rescale(s_t, m_i, _tile_max(s_t, mx_s, MMA, True))  # noqa: F821
            l_t = l_t * alpha[None, :] + p_t
            # the next tile's nine chunks into the registers freed by this tile's conversions:
            # issued here, after the maximum's exchange, their 18 loads a warp do not queue
            # ahead of its shuffles and shared-memory reads (placed among the logits steps,
            # ptxas gathers them just before the exchange: measured 3% slower)
            x0, x1, x2, x3, x4, x5, x6, x7, x8 = _chunks(Cw, rows, LW)
            p_s.store(p_t.to(F16))
            fence_async_shared()  # noqa: F821 -- the latent's and p's stores, for the MMAs
            _cta_barrier()  # noqa: F821
            o0 = _pv(o0, c0.index(z), p_s, alpha)
            o1 = _pv(o1, c1.index(z), p_s, alpha)
            o2 = _pv(o2, c2.index(z), p_s, alpha)
            o3 = _pv(o3, c3.index(z), p_s, alpha)
            o4 = _pv(o4, c4.index(z), p_s, alpha)
            o5 = _pv(o5, c5.index(z), p_s, alpha)
            o6 = _pv(o6, c6.index(z), p_s, alpha)
            o7 = _pv(o7, c7.index(z), p_s, alpha)
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(  # noqa: F821
                num_outstanding=0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
            _cta_barrier()  # noqa: F821 -- every warp's P . latent has read the blocks and p

        l_i = gl.sum(l_t, axis=0)
        # o^T's eight column blocks, each 64 rows of mla_decode_gluon's epilogue
        LO: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])
        blocks = (o0, o1, o2, o3, o4, o5, o6, o7)
        for j in gl.static_range(8):
            _write_out(blocks[j], m_i, l_i, OUT, OP, LSE, req, h0, s, num_splits,  # noqa: F821
                       stride_ot, stride_oh, out_scale, H, RANK, BLOCK_H, SINGLE, MMA, MMA, LO,
                       64 * j)

    return _mla_decode_fp8_regs
