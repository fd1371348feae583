"""The int4 (KIVI) paged decode written in Gluon for Hopper: each tile's nibbles are dequantized
once into shared memory and both products run on warp-group MMAs.

Why. The Triton kernel of ``decode_int4_kernels`` converts the codes into the MMA operands'
register layout, and ncu found it bound by shared-memory traffic and latency (3 programs per
SM, 0.33x the fp8 decode's speed on 128-d heads; docs/benchmarks.md). Here a tile's path is
written out, as the Gluon MLA decode does (``mla_decode_gluon``):

    K, V codes, K's scale and zero --cp.async--> stage[i % STAGES] (STAGES - 1 tiles in flight)
    K codes --prmt/lop3/sub/fma.f16x2 (scale, zero per channel of a page)--> kt [64, D] float16
    V codes --... (scale, zero per token and 32 channels)--> vt [64, D] float16
    s^T [64, H] = kt . q^T            (warp-group MMAs, the query in shared memory all along)
    o^T [D, H] += vt^T . p^T          (a transposed view of vt)

A tile is two pages (64 tokens). K's scale and zero (per channel and page, the pool's
quantization group) travel with the tile's codes into shared memory and are applied by the
conversion, as V's (per token and 32 channels, loaded into registers a tile ahead) are: one
float16 rounding of ``code * scale + zero``, as the reference's dequantization. (The
seventeenth session's kernel folded K's scale into the query instead: two logits MMAs a tile,
one per page, plus two bias MMAs for the zero terms, and a fold per tile on the CUDA cores.)
Channels stay in the pool's even-first order inside the kernel (a byte's low nibble is the even
channel); q is loaded and the output written in that order. The request's residual page (its
last ``kv_len % 32`` tokens, full precision) is attended by the last split through the same
tiles. Heads are the MMAs' N (the query group, padded to ``BLOCK_H`` >= 8), tokens their M.

Grid ``(batch, kv heads, splits)`` and outputs as the Triton kernel's: one split writes ``OUT``,
several write float32 partials ``OP`` (rows ``(b * Hq + head) * splits + s``) and base-2
log-sum-exp ``LSE`` (every split, an empty one -inf) for ``decode_kernels``' merge. Owns nothing.
"""
from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names, mha_decode_parts

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names(), **mha_decode_parts())

    # packed bytes -> nibbles under the exponent of 1024, four bytes an asm: prmt spreads two
    # bytes into a register's halves (a: bytes 0-1, b: 2-3), lop3 puts a nibble under the
    # exponent (low: 1024 + c, high: 1024 + 16 c); sub / fma remove it exactly, and fma applies
    # the scale and zero
    head = ("{\n.reg .b32 a, b, t, c, m, n, k, o;\n"
            "mov.b32 c, 0x64006400;\nmov.b32 m, 0x000f000f;\nmov.b32 n, 0x00f000f0;\n"
            "mov.b32 k, 0x2c002c00;\nmov.b32 o, 0xd400d400;\n"
            "prmt.b32 a, $4, 0, 0x4140;\nprmt.b32 b, $4, 0, 0x4342;\n")
    low, high = "lop3.b32 t, {}, m, c, 0xea;\n", "lop3.b32 t, {}, n, c, 0xea;\n"

    def dequant(hi: int) -> str:
        # code * scale + zero, one float16 rounding as the reference's: $5/$6 the low nibbles'
        # scales and $7/$8 their zeros (a's and b's halves), the high nibbles' from $hi on
        # (V: 5, the same scale per token and group; K: 9, an odd channel's own)
        return head + "".join(
            [low.format(r) + f"sub.f16x2 t, t, c;\nfma.rn.f16x2 ${i}, t, ${5 + i}, ${7 + i};\n"
             for i, r in enumerate("ab")]
            + [high.format(r) + f"fma.rn.f16x2 t, t, k, o;\nfma.rn.f16x2 ${i + 2}, t, "
               f"${hi + i}, ${hi + 2 + i};\n" for i, r in enumerate("ab")]) + "}\n"

    globals().update(_DEQUANT_ASM=gl.constexpr(dequant(5)),
                     _DEQUANT_K_ASM=gl.constexpr(dequant(9)))

    @gluon.jit
    def _dequant(x, sc, zr):
        # packed bytes -> (low nibbles, high nibbles) as code * scale + zero in float16
        return gl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,=r,=r,r,r,r,r,r",  # noqa: F821
                                         [x, sc, zr], dtype=(gl.float16, gl.float16),
                                         is_pure=True, pack=4)

    @gluon.jit
    def _dequant_k(x, sl, zl, sh, zh):
        # as _dequant, with the high nibbles' own scale and zero
        return gl.inline_asm_elementwise(_DEQUANT_K_ASM,  # noqa: F821
                                         "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [x, sl, zl, sh, zh],
                                         dtype=(gl.float16, gl.float16), is_pure=True, pack=4)

    @gluon.jit
    def _rows(t0, p1, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, L: gl.constexpr):
        # (page index, token in page) of the tile's rows from page t0 (layout L); pages >= p1
        # are not the split's: their index is returned as p1 (the caller masks them)
        r = gl.arange(0, BLOCK_N, layout=L)
        pidx = t0 + r // PAGE
        return gl.minimum(pidx, p1), r % PAGE

    @gluon.jit
    def _issue(stage_k, stage_v, stage_kz, KC, VC, KS, KZ, bt_row, t0, p1, base, stride_kp,
               HALF: gl.constexpr, NG: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
               PAGE: gl.constexpr, NPG: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
               LZ: gl.constexpr):
        # one commit group of cp.async for the tile's pages from t0 (pages >= p1 zero-filled,
        # never used): K codes [NPG, PAGE, HALF], V codes [BLOCK_N, NG, 16], K's scale and
        # zero [2, NPG, D] (KS, KZ: this head's)
        LK2: gl.constexpr = gl.SliceLayout(2, LK)
        pk = t0 + gl.arange(0, NPG, layout=gl.SliceLayout(1, LK2))
        pgk = gl.load(bt_row + gl.minimum(pk, p1), mask=pk < p1, other=0).to(gl.int64)
        tk = gl.arange(0, PAGE, layout=gl.SliceLayout(0, LK2))
        c = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK)))
        rowk = (pgk * base)[:, None] + (tk * HALF)[None, :]  # [NPG, PAGE]
        _cp_async(stage_k, KC + rowk[:, :, None] + c[None, None, :],  # noqa: F821
                  mask=(pk < p1)[:, None, None])
        LV2: gl.constexpr = gl.SliceLayout(2, LV)
        pv, tv = _rows(t0, p1, BLOCK_N, PAGE, gl.SliceLayout(1, LV2))
        pgv = gl.load(bt_row + pv, mask=pv < p1, other=0).to(gl.int64)
        g = gl.arange(0, NG, layout=gl.SliceLayout(0, LV2))
        i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LV)))
        rowv = (pgv * base + tv * HALF)[:, None] + g[None, :] * 16  # [BLOCK_N, NG]
        ptr = VC + rowv[:, :, None] + i[None, None, :]
        _cp_async(stage_v, ptr, mask=(pv < p1)[:, None, None])  # noqa: F821
        LZ2: gl.constexpr = gl.SliceLayout(2, LZ)
        which = gl.arange(0, 2, layout=gl.SliceLayout(1, LZ2))  # 0: scale, 1: zero
        pz = t0 + gl.arange(0, NPG, layout=gl.SliceLayout(0, LZ2))
        pgz = gl.load(bt_row + gl.minimum(pz, p1), mask=pz < p1, other=0).to(gl.int64)
        cz = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, LZ)))
        off = (pgz * stride_kp)[None, :, None] + cz[None, None, :]  # [1, NPG, D]
        _cp_async(stage_kz, gl.where((which == 0)[:, None, None], KS + off, KZ + off),  # noqa: F821
                  mask=(pz < p1)[None, :, None])
        async_copy.commit_group()

    @gluon.jit
    def _v_scales(VS, VZ, bt_row, t0, p1, h, stride_vp, stride_vh, NG: gl.constexpr,
                  BLOCK_N: gl.constexpr, PAGE: gl.constexpr, LV: gl.constexpr):
        # V's scale and zero per token and 32 channels of the tile's pages from t0
        # ([BLOCK_N, NG] float16, 0 past p1)
        LV2: gl.constexpr = gl.SliceLayout(2, LV)
        pv, tv = _rows(t0, p1, BLOCK_N, PAGE, gl.SliceLayout(1, LV2))
        pgv = gl.load(bt_row + pv, mask=pv < p1, other=0).to(gl.int64)
        g = gl.arange(0, NG, layout=gl.SliceLayout(0, LV2))
        vo = (pgv * stride_vp + h * stride_vh + tv * NG)[:, None] + g[None, :]
        vmask = (pv < p1)[:, None] & (g < NG)[None, :]
        return gl.load(VS + vo, mask=vmask, other=0.0), gl.load(VZ + vo, mask=vmask, other=0.0)

    @gluon.jit
    def _attend(kt, vt, qs, p_s, acc, m_i, l_t, n_live, BLOCK_H: gl.constexpr,
                MMA: gl.constexpr):
        # one tile: s^T = kt . q^T (the query holds the base-2 softmax scale); rows >= n_live
        # weigh 0; the online softmax and o^T += vt^T . p^T. The running sum stays per row of
        # the tile (l_t [64, BLOCK_H]), summed over the rows once at the end: no cross-warp
        # reduction for it per tile
        zero = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        s_t = warpgroup_mma(kt, qs.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        s_t = gl.where((r < n_live)[:, None], s_t, float("-inf"))
        m_new, alpha, p_t, l_t = _online_softmax(s_t, m_i, l_t)  # noqa: F821
        p_s.store(p_t.to(gl.float16))
        fence_async_shared()
        _cta_barrier()  # noqa: F821
        acc = warpgroup_mma(vt.permute((1, 0)), p_s, acc * alpha[None, :], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return acc, m_new, l_t

    @gluon.jit
    def _k_scale_zero(kz, LK: gl.constexpr, LZR: gl.constexpr):
        # K's scale and zero [NPG, HALF] each from kz [2, NPG, HALF] (shared memory), in the
        # layout of LK without its rows: a thread reads its columns of its rows' page (LZR
        # holds both values of a channel in one thread, so the split moves nothing)
        sz = gl.permute(kz.load(LZR), (1, 2, 0))  # [NPG, HALF, 2]
        sc, zr = gl.split(sz)
        return (gl.convert_layout(sc, gl.SliceLayout(1, LK)),
                gl.convert_layout(zr, gl.SliceLayout(1, LK)))

    @gluon.jit
    def _convert(stage_k, stage_v, stage_kz, kt, vt, vs, vz, HALF: gl.constexpr,
                 BLOCK_N: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
                 LZR: gl.constexpr):
        # a stage into the float16 tiles (even channels in columns [0, HALF), odd in
        # [HALF, D)): K as code * scale + zero with its page's per-channel scale and zero
        # (stage_kz [2, NPG, D]: a thread reads its columns' for its rows' page), V with its
        # per-token-and-group ones
        sl, zl = _k_scale_zero(stage_kz.slice(0, HALF, 2), LK, LZR)
        sh, zh = _k_scale_zero(stage_kz.slice(HALF, HALF, 2), LK, LZR)
        k_lo, k_hi = _dequant_k(stage_k.load(LK), sl[:, None, :], zl[:, None, :],
                                sh[:, None, :], zh[:, None, :])  # [NPG, PAGE, HALF] each
        kt.slice(0, HALF, 1).store(gl.reshape(k_lo, [BLOCK_N, HALF]))
        kt.slice(HALF, HALF, 1).store(gl.reshape(k_hi, [BLOCK_N, HALF]))
        v_lo, v_hi = _dequant(stage_v.load(LV), vs[:, :, None], vz[:, :, None])
        vt.slice(0, HALF, 1).store(gl.reshape(v_lo, [BLOCK_N, HALF]))
        vt.slice(HALF, HALF, 1).store(gl.reshape(v_hi, [BLOCK_N, HALF]))

    @gluon.jit
    def _residual_half(R, row, tail, HI: gl.constexpr, HALF: gl.constexpr,
                       BLOCK_N: gl.constexpr, L: gl.constexpr):
        # even (HI False) or odd channels of the residual rows [BLOCK_N, HALF] (rows >= tail
        # zero), float16
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, HALF, layout=gl.SliceLayout(0, L))
        ptr = R + row + (r * (2 * HALF))[:, None] + (2 * c + HI)[None, :]
        return gl.load(ptr, mask=(r < tail)[:, None], other=0.0).to(gl.float16)

    @gluon.jit
    def _int4_decode_gluon(Q, OUT, OP, LSE, KC, VC, KS, KZ, VS, VZ, KR, VR, BT, KVLEN, RSLOT,
                           stride_qb, stride_qh, stride_ob, stride_oh, stride_cp, stride_ch,
                           stride_kp, stride_kh, stride_vp, stride_vh, stride_rs, stride_rh,
                           stride_bt, qk_scale, num_splits,
                           G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,
                           PAGE: gl.constexpr, STAGES: gl.constexpr, SINGLE: gl.constexpr,
                           num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(PAGE == 32, "the int4 pool's pages (K's quantization group)")
        b = gl.program_id(0)
        h = gl.program_id(1)
        s = gl.program_id(2)
        HALF: gl.constexpr = D // 2
        NG: gl.constexpr = D // 32  # V's channel groups: 16 bytes of codes each
        NPG: gl.constexpr = 2  # pages a tile: 64 tokens, the MMAs' M
        BLOCK_N: gl.constexpr = NPG * PAGE
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        # K's codes [NPG, PAGE, HALF]: 16 bytes a thread along a row, NG / 2 rows, 16 rows a
        # warp, so that a thread's rows share a page (and its scales); V's [rows, NG, 16]: a
        # thread's 16 bytes one channel group of one token (one scale and zero); LR the
        # residual page's rows [BLOCK_N, HALF]
        LK: gl.constexpr = gl.BlockedLayout([1, NG // 2, 16], [1, 32 // NG, NG], [2, 2, 1],
                                            [2, 1, 0])
        LV: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // NG, NG, 1], [4, 1, 1], [2, 1, 0])
        LR: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NG, NG], [4, 1], [1, 0])
        # K's scale and zero [2, NPG, D] float16: D / 32 a thread (4 to 16 bytes a copy); LZR
        # reads [2, NPG, HALF] of them back as LK's threads need them (warps as LK's pages,
        # lanes as its columns, the rest replicated)
        LZ: gl.constexpr = gl.BlockedLayout([1, 1, D // 32], [1, 1, 32], [2, 2, 1], [2, 1, 0])
        LZR: gl.constexpr = gl.BlockedLayout([2, 1, 16], [32 // NG, 1, NG], [1, 2, 2],
                                             [2, 1, 0])
        # the query [BLOCK_H, D] (float32), SPQ values a thread
        SPQ: gl.constexpr = 8 if BLOCK_H * D >= 1024 else BLOCK_H * D // 128
        TPC: gl.constexpr = 32 if D // SPQ >= 32 else D // SPQ
        LQ: gl.constexpr = gl.BlockedLayout([1, SPQ], [32 // TPC, TPC], [4, 1], [1, 0])
        RAW3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        stage_k = gl.allocate_shared_memory(gl.uint8, [STAGES, NPG, PAGE, HALF], RAW3)
        stage_v = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NG, 16], RAW3)
        stage_kz = gl.allocate_shared_memory(gl.float16, [STAGES, 2, NPG, D], RAW3)
        # the float16 tiles, even channels in columns [0, HALF), odd ones in [HALF, D): a
        # swizzle of at most HALF * 2 bytes, so that each half is whole swizzle atoms
        SW: gl.constexpr = 128 if HALF * 2 >= 128 else HALF * 2
        TL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=SW, element_bitwidth=16,
                                                rank=2)
        kt = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D], TL)
        vt = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D], TL)
        qs = gl.allocate_shared_memory(
            gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D],
                                                                           gl.float16))
        p_s = gl.allocate_shared_memory(
            gl.float16, [BLOCK_N, BLOCK_H],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16))

        # the query group [BLOCK_H, D], channels even-first (column c: channel 2c, or 2c - D + 1),
        # times the base-2 softmax scale (the MMAs' logits come out scaled), in shared memory
        # for the whole program (the first tile's barrier and fence publish it)
        hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        chq = gl.where(cq < HALF, 2 * cq, 2 * (cq - HALF) + 1)
        qptr = Q + b.to(gl.int64) * stride_qb + (h * G + hq)[:, None] * stride_qh + chq[None, :]
        q = gl.load(qptr, mask=(hq < G)[:, None], other=0.0).to(gl.float32) * qk_scale
        qs.store(q.to(gl.float16))

        kv_len = gl.load(KVLEN + b)
        nfull = kv_len // PAGE
        tail = kv_len - nfull * PAGE
        per = gl.cdiv(gl.cdiv(nfull, num_splits), NPG) * NPG  # full pages a split, whole tiles
        p0 = s * per
        p1 = gl.minimum(p0 + per, nfull)
        n_tiles = gl.cdiv(gl.maximum(p1 - p0, 0), NPG)
        bt_row = BT + b.to(gl.int64) * stride_bt
        KCh = KC + h * stride_ch
        VCh = VC + h * stride_ch
        KSh = KS + h * stride_kh
        KZh = KZ + h * stride_kh

        for t in gl.static_range(STAGES - 1):
            _issue(stage_k.index(t), stage_v.index(t), stage_kz.index(t), KCh, VCh, KSh, KZh,
                   bt_row, p0 + NPG * t, p1, stride_cp, stride_kp, HALF, NG, D, BLOCK_N, PAGE,
                   NPG, LK, LV, LZ)
        # the first tile's V scales; later ones are loaded a tile ahead, into registers
        vs, vz = _v_scales(VS, VZ, bt_row, p0, p1, h, stride_vp, stride_vh, NG, BLOCK_N, PAGE,
                           LV)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_t = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        acc = gl.zeros([D, BLOCK_H], gl.float32, layout=MMA)
        for i in range(n_tiles):
            t0 = p0 + NPG * i
            _cta_barrier()  # noqa: F821 -- the last tile's MMAs and reads are done everywhere
            j = i + STAGES - 1
            _issue(stage_k.index(j % STAGES), stage_v.index(j % STAGES),
                   stage_kz.index(j % STAGES), KCh, VCh, KSh, KZh, bt_row, p0 + NPG * j, p1,
                   stride_cp, stride_kp, HALF, NG, D, BLOCK_N, PAGE, NPG, LK, LV, LZ)
            vs_c = vs
            vz_c = vz
            # the next tile's V scales, loaded into registers a tile ahead
            vs, vz = _v_scales(VS, VZ, bt_row, t0 + NPG, p1, h, stride_vp, stride_vh, NG,
                               BLOCK_N, PAGE, LV)
            async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
            _cta_barrier()  # noqa: F821 -- and every thread's
            cur = i % STAGES
            _convert(stage_k.index(cur), stage_v.index(cur), stage_kz.index(cur), kt, vt, vs_c,
                     vz_c, HALF, BLOCK_N, LK, LV, LZR)
            fence_async_shared()
            _cta_barrier()  # noqa: F821
            n_live = gl.minimum(p1 - t0, NPG) * PAGE
            acc, m_i, l_t = _attend(kt, vt, qs, p_s, acc, m_i, l_t, n_live, BLOCK_H, MMA)
        async_copy.wait_group(0)

        if (tail > 0) & (s == num_splits - 1):  # the residual page, full precision
            _cta_barrier()  # noqa: F821
            slot = gl.maximum(gl.load(RSLOT + b), 0).to(gl.int64)  # padded rows: -1
            row = slot * stride_rs + h * stride_rh
            kt.slice(0, HALF, 1).store(_residual_half(KR, row, tail, 0, HALF, BLOCK_N, LR))
            kt.slice(HALF, HALF, 1).store(_residual_half(KR, row, tail, 1, HALF, BLOCK_N, LR))
            vt.slice(0, HALF, 1).store(_residual_half(VR, row, tail, 0, HALF, BLOCK_N, LR))
            vt.slice(HALF, HALF, 1).store(_residual_half(VR, row, tail, 1, HALF, BLOCK_N, LR))
            fence_async_shared()
            _cta_barrier()  # noqa: F821
            acc, m_i, l_t = _attend(kt, vt, qs, p_s, acc, m_i, l_t, tail, BLOCK_H, MMA)

        # o^T = acc [D, BLOCK_H] / l, rows even-first -> channels in order
        _split_out(acc, l_t, m_i, OUT, OP, LSE, b, h, s, num_splits, stride_ob,  # noqa: F821
                   stride_oh, 1.0, G, BLOCK_H, D, SINGLE, 1, MMA)

    return _int4_decode_gluon
