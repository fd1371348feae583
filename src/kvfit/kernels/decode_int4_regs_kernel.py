"""The int4 (KIVI) paged decode in Gluon for Hopper with the MMAs' A operands from registers,
over int4 pools with token-minor V pages (``Int4KVCache`` with ``v_layout`` "HDN").

Why. The first Gluon int4 kernel (``decode_int4_gluon``) converts each tile's nibbles into
float16 tiles in shared memory: its per-tile chain of copies, stores, fences and barriers held it
at 0.94-0.97x the fp8 decode's speed on Qwen3 heads (H100), while int4 reads 0.625 bytes per
value against fp8's 1. The 8-bit Gluon decode (``decode_8bit_gluon_kernel``) showed the way
out: load the codes in a layout that the conversion turns into the MMA's operand layout, so a
tile never touches shared memory but for P. Here, per tile of 64 tokens (two pages):

    K codes (token-major), V codes (token-minor), V's scale and zero per token and 32
    channels --8/16-byte loads, a tile ahead--> registers; K's scale and zero per channel of
    the page: a tile ahead (KS_AHEAD) or at their tile (fewer registers carried)
    K words --prmt/lop3/sub/fma.f16x2--> kt [64, D] float16 (code * scale + zero), A operand
    V words --shr/prmt/lop3/sub/fma.f16x2--> vt [D, 64] float16, A operand of P.V
    s^T [64, H] = kt . q^T        (the query in shared memory all along, channels relabelled)
    o^T [D, H] += vt . p^T        (p^T in shared memory)

The relabellings and the asm are in ``decode_int4_regs_layouts``. The split's last tile may hold
one page (the other masked); the request's residual page (its last ``kv_len % 32`` tokens, full
precision) is the last split's extra tile, its operands loaded straight into the A layouts.
Pages past a split's last are read as that page (in bounds, no predicated loads), and a masked
tile sets their logits to -inf and their V values to 0. ``L2_AHEAD`` > 0: tile i also asks L2
for tile i + L2_AHEAD's lines (``_l2_ask``), so that its loads, which ptxas issues late in the
tile before, wait for L2 rather than DRAM.

Grid ``(batch, kv heads, splits)`` and outputs as the Triton int4 kernel's: one split writes
``OUT``, several write float32 partials ``OP`` and base-2 log-sum-exp ``LSE`` (every split; an
empty one -inf) for ``decode_kernels``' merge. Owns nothing.
"""
from __future__ import annotations

import functools

from kvfit.kernels.decode_int4_regs_layouts import K_WORD_ASM, V_WORD_ASM


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names, mha_decode_parts

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names(), **mha_decode_parts())
    globals().update(_K_ASM=gl.constexpr(K_WORD_ASM), _V_ASM=gl.constexpr(V_WORD_ASM))  # noqa

    @gluon.jit
    def _words(x, s0, s1, s2, s3, z0, z1, z2, z3, ASM: gl.constexpr):
        # 32-bit words [...] of eight codes -> float16 [..., 2, 2, 2] (the asm's outputs o0..o7
        # at [.., e1, e0, b0] = o(4 e1 + 2 e0 + b0): b0, the pair in one register, innermost)
        o = gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
                                      [x, s0, s1, s2, s3, z0, z1, z2, z3],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        return gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])),
                       gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))

    @gluon.jit
    def _k_channel(k, D: gl.constexpr):
        # the physical channel at the logits' hardware k = 16 ks + 8 b3 + 2 c + b0
        return ((k >> 1) & 3) * (D // 4) + (k >> 4) * 4 + ((k >> 3) & 1) + (k & 1) * 2

    @gluon.jit
    def _dup(x, LA: gl.constexpr):
        # x [4, 8, W] -> [4, 2, 8, W] in LA, the same registers for both rows of a thread
        return gl.convert_layout(gl.permute(gl.join(x, x), (0, 3, 1, 2)), LA,
                                 assert_trivial=True)

    @gluon.jit
    def _spread(x, D: gl.constexpr, LA: gl.constexpr):
        # x [32, 2, 4] -> [32, D/32, 2, 4] in LA, the same registers for a thread's channels
        y = gl.permute(gl.join(x, x), (0, 3, 1, 2))  # [32, 2, 2, 4]
        if D >= 128:
            y = gl.reshape(gl.permute(gl.join(y, y), (0, 4, 1, 2, 3)), [32, 4, 2, 4])
        if D >= 256:
            y = gl.reshape(gl.permute(gl.join(y, y), (0, 4, 1, 2, 3)), [32, 8, 2, 4])
        return gl.convert_layout(y, LA, assert_trivial=True)

    @gluon.jit
    def _load(KCh, VCh, VSh, VZh, bt_row, p0, last, stride_cp, stride_kp, stride_vp,
              D: gl.constexpr, LK: gl.constexpr, LKS: gl.constexpr, LV4: gl.constexpr,
              LVS: gl.constexpr):
        # the tile of pages p0, p0 + 1 as 32-bit words (a page past ``last``, the split's last,
        # loads that page again; the caller masks it): K's codes [64 rows, D/8], the word
        # offsets of its pages' scale rows [4, 8] (for _k_scales), V's codes [32, D/32, 2, 4]
        # and its scale and zero words [32, 2, 4, 4] (LVS)
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, LK))
        tok = _tile_token(m, 64)  # noqa: F821
        pk = p0 + (tok >> 5)
        pgk = gl.load(bt_row + gl.minimum(pk, last)).to(gl.int64)
        rows = (KCh + pgk * stride_cp + (tok & 31) * (D // 2)).to(gl.pointer_type(gl.int32),
                                                                  bitcast=True)
        w = gl.arange(0, D // 8, layout=gl.SliceLayout(0, LK))
        k = gl.load(rows[:, None] + w[None, :])
        # K's scales: the page of lane row l (its bit 2; a row's page is its lane row's: the
        # rows' page ids, relabelled, no second load), words 2 w + (a, b) of the even half
        pgs, _ = gl.split(gl.permute(gl.reshape(pgk, [4, 2, 8]), (0, 2, 1)))
        soff = gl.convert_layout((pgs * stride_kp) // 2, gl.SliceLayout(2, LKS),
                                 assert_trivial=True)  # [4, 8]
        # V's codes: channel (thread row, j), page, word (16 bytes a page row)
        LV2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LV4))  # [32, D/32]
        tau = gl.arange(0, 32, layout=gl.SliceLayout(1, LV2))
        jj = gl.arange(0, D // 32, layout=gl.SliceLayout(0, LV2))
        ch = (tau * (D // 32))[:, None] + jj[None, :]
        LVP: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LV4)))
        pv = p0 + gl.arange(0, 2, layout=LVP)
        pgv = gl.load(bt_row + gl.minimum(pv, last)).to(gl.int64)
        wv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV4))))
        vbase = (VCh + (pgv * stride_cp)[None, None, :] + (ch * 16)[:, :, None]).to(
            gl.pointer_type(gl.int32), bitcast=True)  # [32, D/32, 2]
        v = gl.load(vbase[:, :, :, None] + wv[None, None, None, :])
        # V's scales: the group of the thread's channels, its 16 tokens (pair words)
        LVS2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LVS))  # [32, 2]
        tv = gl.arange(0, 32, layout=gl.SliceLayout(1, LVS2))
        pgvs = gl.convert_layout(pgv, gl.SliceLayout(0, LVS2), assert_trivial=True)
        grp = (tv * (D // 32)) // 32
        voff = ((pgvs * stride_vp) // 2)[None, :] + (grp * 16)[:, None]  # [32, 2] words
        LVSW: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LVS))  # [4, 4]
        vw = gl.arange(0, 4, layout=gl.SliceLayout(1, LVSW))
        vp = gl.arange(0, 4, layout=gl.SliceLayout(0, LVSW))
        voff4 = voff[:, :, None, None] + (4 * vw[:, None] + vp[None, :])[None, None, :, :]
        vs = gl.load(VSh.to(gl.pointer_type(gl.int32), bitcast=True) + voff4)
        vz = gl.load(VZh.to(gl.pointer_type(gl.int32), bitcast=True) + voff4)
        return k, soff, v, vs, vz

    @gluon.jit
    def _l2_lanes(KCh, VCh, KSh, KZh, VSh, VZh, stride_cp, stride_kp, stride_vp,
                  D: gl.constexpr):
        # which 128-byte line of a tile each thread asks L2 for (_l2_ask): [2 pages, 64, R]
        # (warps 0-1 the tile's first page, 2-3 its second). A page's L = 5 D / 16 lines: its K
        # codes (D / 8 lines), V codes (D / 8), K's scales, K's zeros, V's scales, V's zeros
        # (D / 64 each); R = cdiv(L, 64) a thread, lanes past L repeat lines from the first.
        # Returns the line's byte address in page 0 of the pool (int64) and the bytes from one
        # pool page to the next (int32)
        L: gl.constexpr = 5 * D // 16
        R: gl.constexpr = (L + 63) // 64
        LP: gl.constexpr = gl.BlockedLayout([1, 1, R], [1, 32, 1], [2, 2, 1], [2, 1, 0])
        lane = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(0, LP)))
        rr = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(0, LP)))
        pg = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, LP)))
        r = ((lane[:, None] * R + rr[None, :]) % L)[None, :, :] + 0 * pg[:, None, None]
        q = r - D // 4  # the scale lines: array q // (D / 64), line q % (D / 64)
        kind = q // (D // 64)
        scale = (gl.where(kind == 0, KSh.to(gl.int64), gl.where(kind == 1, KZh.to(gl.int64),
                 gl.where(kind == 2, VSh.to(gl.int64), VZh.to(gl.int64))))
                 + (q % (D // 64)) * 128)
        line = gl.where(r < D // 8, KCh.to(gl.int64) + r * 128, gl.where(
            r < D // 4, VCh.to(gl.int64) + (r - D // 8) * 128, scale))
        per_page = gl.where(r < D // 4, stride_cp, gl.where(kind < 2, 2 * stride_kp,
                                                            2 * stride_vp))
        return line, per_page

    @gluon.jit
    def _l2_ask(bt_row, p, last, line, per_page, D: gl.constexpr):
        # ask L2 for the tile of pages p, p + 1 (a page past ``last``, the split's last, is
        # that page again), one line a thread of _l2_lanes' (fire and forget: no register waits
        # for it), so that the tile's loads, tiles later, find their lines in L2, not DRAM
        R: gl.constexpr = (5 * D // 16 + 63) // 64
        LP: gl.constexpr = gl.BlockedLayout([1, 1, R], [1, 32, 1], [2, 2, 1], [2, 1, 0])
        pl = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, LP)))
        pg = gl.load(bt_row + gl.minimum(p + pl, last)).to(gl.int64)
        _l2_prefetch(line + pg[:, None, None] * per_page)  # noqa: F821

    @gluon.jit
    def _k_scales(KSh, KZh, soff, D: gl.constexpr, LKS: gl.constexpr):
        # K's scale and zero words [4, 8, D/4] of the pages at word offsets soff [4, 8]: the
        # even channels' (ks_e, kz_e), then the odd ones' (ks_o, kz_o)
        ww = gl.arange(0, D // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LKS)))
        off = soff[:, :, None] + ww[None, None, :]  # [4, 8, D/4] int32 words
        KSw = KSh.to(gl.pointer_type(gl.int32), bitcast=True)
        KZw = KZh.to(gl.pointer_type(gl.int32), bitcast=True)
        return (gl.load(KSw + off), gl.load(KSw + off + D // 4), gl.load(KZw + off),
                gl.load(KZw + off + D // 4))

    @gluon.jit
    def _convert_k(k, ks_e, ks_o, kz_e, kz_o, D: gl.constexpr, LK4: gl.constexpr,
                   LAK: gl.constexpr):
        # a tile's K words -> kt [64, D] float16 in the logits' A-operand layout
        k4 = gl.convert_layout(gl.reshape(k, [4, 2, 8, D // 8]), LK4, assert_trivial=True)
        sea, seb = gl.split(gl.reshape(ks_e, [4, 8, D // 8, 2]))
        soa, sob = gl.split(gl.reshape(ks_o, [4, 8, D // 8, 2]))
        zea, zeb = gl.split(gl.reshape(kz_e, [4, 8, D // 8, 2]))
        zoa, zob = gl.split(gl.reshape(kz_o, [4, 8, D // 8, 2]))
        kf = _words(k4, _dup(sea, LK4), _dup(soa, LK4), _dup(seb, LK4), _dup(sob, LK4),
                    _dup(zea, LK4), _dup(zoa, LK4), _dup(zeb, LK4), _dup(zob, LK4), _K_ASM)  # noqa
        # natural column n = 8 w + 4 e1 + 2 e0 + b0 of a thread's D/4 -> hardware k
        return _hw_k(gl.reshape(kf, [64, D]), 64, D, LAK)  # noqa: F821

    @gluon.jit
    def _convert_v(v, vs, vz, D: gl.constexpr, LV4: gl.constexpr, LAV: gl.constexpr):
        # a tile's V words -> vt [D, 64] float16 in P.V's A-operand layout
        # V's pair words p = 2 a + b of [.., 4] -> p0..p3 (the tokens (2p, 2p + 1))
        sb0, sb1 = gl.split(gl.reshape(vs, [32, 2, 4, 2, 2]))
        s0, s2 = gl.split(sb0)
        s1, s3 = gl.split(sb1)
        zb0, zb1 = gl.split(gl.reshape(vz, [32, 2, 4, 2, 2]))
        z0, z2 = gl.split(zb0)
        z1, z3 = gl.split(zb1)
        vf = _words(v, _spread(s0, D, LV4), _spread(s1, D, LV4), _spread(s2, D, LV4),
                    _spread(s3, D, LV4), _spread(z0, D, LV4), _spread(z1, D, LV4),
                    _spread(z2, D, LV4), _spread(z3, D, LV4), _V_ASM)  # noqa: F821
        # rows (w, l, i, h) -> 64 i + 16 w + 8 h + l; columns (c, ks, b3, b0) -> hardware k
        vt = gl.reshape(vf, [4, 8, D // 64, 2, 4, 4, 2, 2])
        vt = gl.reshape(gl.permute(vt, (2, 0, 3, 1, 5, 6, 4, 7)), [D, 64])
        return gl.convert_layout(vt, LAV, assert_trivial=True)

    @gluon.jit
    def _residual(KR, VR, row, tail, D: gl.constexpr, LAK: gl.constexpr, LAV: gl.constexpr):
        # the residual page's first ``tail`` tokens (rows of [32, D], compute dtype) straight
        # into the A layouts: kt [64, D] (rows by _tile_token, columns by _k_channel), vt [D, 64]
        # (rows by _thread_rows_channel, columns by _tile_token); tokens from tail on are zeros
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, LAK))
        tk = _tile_token(m, 64)  # noqa: F821
        kk = gl.arange(0, D, layout=gl.SliceLayout(0, LAK))
        kt = gl.load(KR + row + (tk * D)[:, None] + _k_channel(kk, D)[None, :],
                     mask=(tk < tail)[:, None], other=0.0).to(gl.float16)
        r = gl.arange(0, D, layout=gl.SliceLayout(1, LAV))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, LAV))
        tv = _tile_token(c, 64)  # noqa: F821
        vt = gl.load(VR + row + _thread_rows_channel(r, D)[:, None] + (tv * D)[None, :],  # noqa
                     mask=(tv < tail)[None, :], other=0.0).to(gl.float16)
        return kt, vt

    @gluon.jit
    def _logits(kt, qs, BLOCK_H: gl.constexpr, MMA: gl.constexpr):
        # s^T [64, BLOCK_H] = K . q^T (the query holds the base-2 softmax scale), issued
        zero = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        return warpgroup_mma(kt, qs.permute((1, 0)), zero, use_acc=False,  # noqa: F821
                             is_async=True)

    @gluon.jit
    def _attend(s_t, vt, p_s, mx_s, acc, m_i, l_t, n_live, tok_r, tok_k, MASKED: gl.constexpr,
                MMA: gl.constexpr, XMAX: gl.constexpr):
        # the rest of a tile (MASKED: its tokens from n_live on are dead: logits -inf, V zeroed,
        # since a page past the split's repeats its last one): the online softmax,
        # o^T += V^T . p^T. The running sum stays per row of the tile (l_t [64, BLOCK_H]).
        # XMAX: the tile's maximum through mx_s with one barrier (_tile_max), which also
        # orders the last tile's P.V before this tile's store of p_s
        if MASKED:
            vt = gl.where((tok_k < n_live)[None, :], vt, 0.0)
            s_t = gl.where((tok_r < n_live)[:, None], s_t, float("-inf"))
        m_new, alpha, p_t, l_t = _online_softmax_to(  # noqa: F821
            s_t, m_i, l_t, _tile_max(s_t, mx_s, MMA, XMAX))  # noqa: F821
        return _pv_step(p_t, vt, p_s, acc, alpha, XMAX), m_new, l_t  # noqa: F821

    @gluon.jit
    def _int4_decode_regs(Q, OUT, OP, LSE, KC, VC, KS, KZ, VS, VZ, KR, VR, BT, KVLEN, RSLOT,
                          stride_qb, stride_qh, stride_ob, stride_oh, stride_cp, stride_ch,
                          stride_kp, stride_kh, stride_vp, stride_vh, stride_rs, stride_rh,
                          stride_bt, qk_scale, num_splits,
                          G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,
                          PAGE: gl.constexpr, SINGLE: gl.constexpr, MMA: gl.constexpr,
                          LK: gl.constexpr, LK4: gl.constexpr, LKS: gl.constexpr,
                          LV4: gl.constexpr, LVS: gl.constexpr, LAK: gl.constexpr,
                          LAV: gl.constexpr, KS_AHEAD: gl.constexpr, XMAX: gl.constexpr,
                          L2_AHEAD: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(PAGE == 32, "the int4 pool's pages of 32 tokens")
        b = gl.program_id(0)
        h = gl.program_id(1)
        s = gl.program_id(2)
        # the query group [BLOCK_H, D] times the base-2 softmax scale, its channels in the
        # logits' hardware k order (_k_channel), in shared memory for the whole program
        SPQ: gl.constexpr = 8 if BLOCK_H * D >= 1024 else BLOCK_H * D // 128
        TPC: gl.constexpr = 32 if D // SPQ >= 32 else D // SPQ
        LQ: gl.constexpr = gl.BlockedLayout([1, SPQ], [32 // TPC, TPC], [4, 1], [1, 0])
        hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        qptr = (Q + b.to(gl.int64) * stride_qb + (h * G + hq)[:, None] * stride_qh
                + _k_channel(kq, D)[None, :])
        q = gl.load(qptr, mask=(hq < G)[:, None], other=0.0).to(gl.float32) * qk_scale
        qs = gl.allocate_shared_memory(
            gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D],
                                                                           gl.float16))
        qs.store(q.to(gl.float16))
        p_s = gl.allocate_shared_memory(
            gl.float16, [64, BLOCK_H], gl.NVMMASharedLayout.get_default_for([64, BLOCK_H],
                                                                            gl.float16))
        mx_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821

        # split s: full pages [p0, p1), whole tiles of two pages (as the Triton kernel cuts)
        kv_len = gl.load(KVLEN + b)
        nfull = kv_len // PAGE
        tail = kv_len - nfull * PAGE
        per = gl.cdiv(gl.cdiv(nfull, num_splits), 2) * 2
        p0 = s * per
        p1 = gl.minimum(p0 + per, nfull)
        last = gl.maximum(p1 - 1, 0)  # pages past it are read as it (in bounds, masked)
        bt_row = BT + b.to(gl.int64) * stride_bt
        KCh = KC + h * stride_ch
        VCh = VC + h * stride_ch
        KSh = KS + h * stride_kh
        KZh = KZ + h * stride_kh
        VSh = VS + h * stride_vh
        VZh = VZ + h * stride_vh
        tok_r = _tile_token(gl.arange(0, 64, layout=gl.SliceLayout(1, MMA)), 64)  # noqa: F821
        tok_k = _tile_token(gl.arange(0, 64, layout=gl.SliceLayout(0, LAV)), 64)  # noqa: F821

        k, soff, v, vs, vz = _load(KCh, VCh, VSh, VZh, bt_row, p0, last, stride_cp, stride_kp,
                                   stride_vp, D, LK, LKS, LV4, LVS)
        ks_e, ks_o, kz_e, kz_o = _k_scales(KSh, KZh, soff, D, LKS)
        if L2_AHEAD > 0:  # tiles 1 .. L2_AHEAD - 1 asked of L2 now, tile i + L2_AHEAD in i
            l2_line, l2_page = _l2_lanes(KCh, VCh, KSh, KZh, VSh, VZh, stride_cp, stride_kp,
                                         stride_vp, D)
            for a in gl.static_range(1, L2_AHEAD):
                _l2_ask(bt_row, p0 + 2 * a, last, l2_line, l2_page, D)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_t = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        acc = gl.zeros([D, BLOCK_H], gl.float32, layout=MMA)
        n_pages = gl.maximum(p1 - p0, 0)
        for i in range(n_pages // 2):
            if not KS_AHEAD:  # K's scales of this tile now (fewer registers carried)
                ks_e, ks_o, kz_e, kz_o = _k_scales(KSh, KZh, soff, D, LKS)
            if L2_AHEAD > 0:
                _l2_ask(bt_row, p0 + 2 * (i + L2_AHEAD), last, l2_line, l2_page, D)
            kt = _convert_k(k, ks_e, ks_o, kz_e, kz_o, D, LK4, LAK)
            vt = _convert_v(v, vs, vz, D, LV4, LAV)
            # the next tile's words into registers while this one is computed
            k, soff, v, vs, vz = _load(KCh, VCh, VSh, VZh, bt_row, p0 + 2 * (i + 1), last,
                                       stride_cp, stride_kp, stride_vp, D, LK, LKS, LV4, LVS)
            if KS_AHEAD:
                ks_e, ks_o, kz_e, kz_o = _k_scales(KSh, KZh, soff, D, LKS)
            s_t = warpgroup_mma_wait(num_outstanding=0,  # noqa: F821
                                     deps=(_logits(kt, qs, BLOCK_H, MMA),))
            acc, m_i, l_t = _attend(s_t, vt, p_s, mx_s, acc, m_i, l_t, 64, tok_r, tok_k, False,
                                    MMA, XMAX)
        if n_pages % 2 == 1:  # the split's last tile: one page (loaded by the last iteration)
            if not KS_AHEAD:
                ks_e, ks_o, kz_e, kz_o = _k_scales(KSh, KZh, soff, D, LKS)
            s_t = _logits(_convert_k(k, ks_e, ks_o, kz_e, kz_o, D, LK4, LAK), qs, BLOCK_H, MMA)
            vt = _convert_v(v, vs, vz, D, LV4, LAV)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))  # noqa: F821
            acc, m_i, l_t = _attend(s_t, vt, p_s, mx_s, acc, m_i, l_t, PAGE, tok_r, tok_k, True,
                                    MMA, XMAX)
        if (tail > 0) & (s == num_splits - 1):  # the residual page, full precision
            slot = gl.maximum(gl.load(RSLOT + b), 0).to(gl.int64)  # padded rows: -1
            kt, vt = _residual(KR, VR, slot * stride_rs + h * stride_rh, tail, D, LAK, LAV)
            s_t = warpgroup_mma_wait(num_outstanding=0,  # noqa: F821
                                     deps=(_logits(kt, qs, BLOCK_H, MMA),))
            acc, m_i, l_t = _attend(s_t, vt, p_s, mx_s, acc, m_i, l_t, tail, tok_r, tok_k, True,
                                    MMA, XMAX)

        # o^T = acc [D, BLOCK_H] / l, rows by _thread_rows_channel
        _split_out(acc, l_t, m_i, OUT, OP, LSE, b, h, s, num_splits, stride_ob,  # noqa: F821
                   stride_oh, 1.0, G, BLOCK_H, D, SINGLE, 2, MMA)

    return _int4_decode_regs
