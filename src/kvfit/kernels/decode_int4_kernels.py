"""The @triton.jit code of the int4 paged decode (``kernels/decode_int4.py`` is the host side and
says what the kernel computes): the per-tile nibble conversion, the online-softmax step and
the split kernel with its tile variants. Owns nothing; the kernel writes ``OUT`` or the split
scratch ``OP``/``LSE``."""

from __future__ import annotations

import functools

from kvfit.kernels.interpret import expose_for_interpreter


@functools.cache
def build():
    """The jitted kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # jit signatures name tl.constexpr

    from kvfit.kernels.nibbles import build as build_nibbles
    from kvfit.kernels.tile_math import build as build_tile_math

    nib = build_nibbles()
    softmax_pv = build_tile_math().softmax_pv
    dequant_lo, dequant_hi, dequant_cast = nib.dequant_lo, nib.dequant_hi, nib.dequant_cast
    codes_lo, codes_hi, codes_cast = nib.codes_lo, nib.codes_hi, nib.codes_cast

    @triton.jit
    def _codes(x, HI: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
        # the even (HI False) or odd channels' codes 0..15 of packed x, float16 or float32
        if F32:
            r = codes_cast(x, HI, tl.float32)
        elif ASM:
            if HI:
                r = codes_hi(x)
            else:
                r = codes_lo(x)
        else:
            r = codes_cast(x, HI, tl.float16)
        return r

    @triton.jit
    def _dequant(x, s, z, HI: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
        # the even (HI False) or odd channels' values of packed codes x, float16 or float32
        if F32:
            r = dequant_cast(x, s, z, HI, tl.float32)
        elif ASM:
            if HI:
                r = dequant_hi(x, s, z)
            else:
                r = dequant_lo(x, s, z)
        else:
            r = dequant_cast(x, s, z, HI, tl.float16)
        return r

    @triton.jit
    def _int4_decode_kernel(Q, OUT, OP, LSE, KC, VC, KS, KZ, VS, VZ, KR, VR, BT, KVLEN, RSLOT,
                            stride_qb, stride_qh, stride_ob, stride_oh,
                            stride_cp, stride_ch, stride_kp, stride_kh, stride_vp, stride_vh,
                            stride_rs, stride_rh, stride_bt, qk_scale, num_splits,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr, NPG: tl.constexpr, F32: tl.constexpr,
                            ASM: tl.constexpr, KFOLD: tl.constexpr, KS_TOKENS: tl.constexpr,
                            SINGLE: tl.constexpr, V_T: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        HALF: tl.constexpr = D // 2
        NG: tl.constexpr = D // 32  # V's channel groups; a group is 16 bytes of codes
        N: tl.constexpr = NPG * PAGE
        PREC: tl.constexpr = "ieee" if F32 else "tf32"
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, HALF)  # channel pair j: channels 2j (low nibble) and 2j + 1 (high)
        d = tl.arange(0, D)
        gmask = g < G
        qrow = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh
        q_e = tl.load(qrow + 2 * j[None, :], mask=gmask[:, None], other=0.0)
        q_o = tl.load(qrow + 2 * j[None, :] + 1, mask=gmask[:, None], other=0.0)
        if F32:
            q_e = q_e.to(tl.float32)
            q_o = q_o.to(tl.float32)
        else:
            q_e = q_e.to(tl.float16)
            q_o = q_o.to(tl.float16)
        kv_len = tl.load(KVLEN + b)
        nfull = kv_len // PAGE
        tail = kv_len - nfull * PAGE
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        per = tl.cdiv(tl.cdiv(nfull, num_splits), NPG) * NPG  # full pages per split
        p0 = s * per
        p1 = tl.minimum(p0 + per, nfull)
        ip = tl.arange(0, NPG)
        t = tl.arange(0, PAGE)
        grp = tl.arange(0, NG)
        c16 = tl.arange(0, 16)
        # K codes as K^T: [D/2, NPG, PAGE] (channel pair, page, token), the MMA's B operand shape
        kt_off = j[:, None, None] + t[None, None, :] * HALF  # [D/2, 1, PAGE]
        # V codes [NPG, PAGE, NG, 16] (page, token, channel group, pair in group)
        v_off = (t[None, :, None, None] * HALF + grp[None, None, :, None] * 16
                 + c16[None, None, None, :])
        vs_off = t[None, :, None, None] * NG + grp[None, None, :, None]  # [1, PAGE, NG, 1]
        # token-minor V (V_T) [NPG, D, PAGE/2] (page, channel, token pair) and the even
        # tokens' scale/zero offsets (group-major rows of PAGE tokens)
        tp = tl.arange(0, PAGE // 2)
        vt_off = d[None, :, None] * (PAGE // 2) + tp[None, None, :]
        vst_off = (d // 32)[None, :, None] * PAGE + 2 * tp[None, None, :]
        bt_row = BT + b.to(tl.int64) * stride_bt
        if KFOLD:  # one page a step, K's scale folded into q: logits = (q*s) . codes + q . z
            q_e32 = q_e.to(tl.float32)
            q_o32 = q_o.to(tl.float32)
            kt_off1 = j[:, None] + t[None, :] * HALF  # [D/2, PAGE]: K^T codes
            v_off1 = t[:, None, None] * HALF + grp[None, :, None] * 16 + c16[None, None, :]
            vs_off1 = t[:, None, None] * NG + grp[None, :, None]  # [PAGE, NG, 1]
            for p in range(p0, p1):
                pg = tl.load(bt_row + p).to(tl.int64)
                cb = pg * stride_cp + h * stride_ch
                kb = tl.load(KC + cb + kt_off1)  # [D/2, PAGE] uint8
                kso = pg * stride_kp + h * stride_kh
                ks_e = tl.load(KS + kso + j).to(tl.float32)  # [D/2], pool order: evens first
                ks_o = tl.load(KS + kso + HALF + j).to(tl.float32)
                kz_e = tl.load(KZ + kso + j).to(tl.float32)
                kz_o = tl.load(KZ + kso + HALF + j).to(tl.float32)
                qs_e = (q_e32 * ks_e[None, :]).to(q_e.dtype)  # [G_PAD, D/2]
                qs_o = (q_o32 * ks_o[None, :]).to(q_e.dtype)
                qz = tl.sum(q_e32 * kz_e[None, :] + q_o32 * kz_o[None, :], 1)  # [G_PAD]
                qk = tl.dot(qs_e, _codes(kb, False, F32, ASM), input_precision=PREC)
                qk = tl.dot(qs_o, _codes(kb, True, F32, ASM), qk, input_precision=PREC)
                qk = (qk + qz[:, None]) * qk_scale  # [G_PAD, PAGE]
                vb = tl.load(VC + cb + v_off1)  # [PAGE, NG, 16]
                vso = pg * stride_vp + h * stride_vh + vs_off1
                vs = tl.load(VS + vso)  # [PAGE, NG, 1]
                vz = tl.load(VZ + vso)
                v_e = _dequant(vb, vs, vz, False, F32, ASM)
                v_o = _dequant(vb, vs, vz, True, F32, ASM)
                v = tl.reshape(tl.join(v_e, v_o), (PAGE, D))  # channels back in order
                acc, m_i, l_i = softmax_pv(qk, v, 1.0, acc, m_i, l_i, 0, False, False, PREC, False)
        else:
            for p in range(p0, p1, NPG):
                live = (p + ip) < p1  # [NPG]
                pg = tl.load(bt_row + p + ip, mask=live, other=0).to(tl.int64)
                cb = pg * stride_cp + h * stride_ch  # [NPG]
                lk = live[None, :, None]
                kb = tl.load(KC + cb[None, :, None] + kt_off, mask=lk, other=0)  # [D/2, NPG, PAGE]
                # K's scale/zero: the even channels' [D/2], then the odd ones' (pool order)
                # (the [D/2, NPG, PAGE] addresses repeat a page's row for its tokens: the loads take
                # the codes' register layout, channels contiguous in a thread, instead of one value
                # per thread; the repeats hit L1)
                if KS_TOKENS:
                    kso = ((pg * stride_kp + h * stride_kh)[None, :, None] + j[:, None, None]
                           + 0 * t[None, None, :])
                else:
                    kso = (pg * stride_kp + h * stride_kh)[None, :, None] + j[:, None, None]
                ks_e = tl.load(KS + kso, mask=lk, other=0.0)  # [D/2, NPG, PAGE or 1]
                ks_o = tl.load(KS + kso + HALF, mask=lk, other=0.0)
                kz_e = tl.load(KZ + kso, mask=lk, other=0.0)
                kz_o = tl.load(KZ + kso + HALF, mask=lk, other=0.0)
                kt_e = tl.reshape(_dequant(kb, ks_e, kz_e, False, F32, ASM), (HALF, N))
                kt_o = tl.reshape(_dequant(kb, ks_o, kz_o, True, F32, ASM), (HALF, N))
                qk = tl.dot(q_e, kt_e, input_precision=PREC)
                qk = tl.dot(q_o, kt_o, qk, input_precision=PREC)  # [G_PAD, N]
                if V_T:  # token-minor pages: a byte holds tokens (2i, 2i + 1) of a channel
                    lt = live[:, None, None]
                    vb = tl.load(VC + cb[:, None, None] + vt_off, mask=lt, other=0)
                    vso = (pg * stride_vp + h * stride_vh)[:, None, None] + vst_off
                    vs_e = tl.load(VS + vso, mask=lt, other=0.0)  # [NPG, D, PAGE/2]
                    vz_e = tl.load(VZ + vso, mask=lt, other=0.0)
                    vs_o = tl.load(VS + vso + 1, mask=lt, other=0.0)
                    vz_o = tl.load(VZ + vso + 1, mask=lt, other=0.0)
                    v = tl.join(_dequant(vb, vs_e, vz_e, False, F32, ASM),
                                _dequant(vb, vs_o, vz_o, True, F32, ASM))  # [.., PAGE/2, 2]
                    v = tl.reshape(tl.permute(tl.reshape(v, (NPG, D, PAGE)), (0, 2, 1)), (N, D))
                else:
                    lv = live[:, None, None, None]
                    vb = tl.load(VC + cb[:, None, None, None] + v_off, mask=lv, other=0)
                    vso = (pg * stride_vp + h * stride_vh)[:, None, None, None] + vs_off
                    vs = tl.load(VS + vso, mask=lv, other=0.0)  # [NPG, PAGE, NG, 1]
                    vz = tl.load(VZ + vso, mask=lv, other=0.0)
                    v_e = _dequant(vb, vs, vz, False, F32, ASM)
                    v_o = _dequant(vb, vs, vz, True, F32, ASM)
                    v = tl.reshape(tl.join(v_e, v_o), (N, D))  # channels back in order
                col = tl.reshape(tl.broadcast_to(live[:, None], (NPG, PAGE)), (N,))
                qk = tl.where(col[None, :], qk * qk_scale, float("-inf"))
                acc, m_i, l_i = softmax_pv(qk, v, 1.0, acc, m_i, l_i, 0, False, False, PREC, False)
        if (tail > 0) & (s == num_splits - 1):  # the partial page, full precision (residual)
            slot = tl.maximum(tl.load(RSLOT + b), 0).to(tl.int64)  # padded rows: -1
            rlive = t < tail
            rrow = slot * stride_rs + h * stride_rh + t[:, None] * D
            k_e = tl.load(KR + rrow + 2 * j[None, :], mask=rlive[:, None], other=0.0)
            k_o = tl.load(KR + rrow + 2 * j[None, :] + 1, mask=rlive[:, None], other=0.0)
            v = tl.load(VR + rrow + d[None, :], mask=rlive[:, None], other=0.0)
            qk = tl.dot(q_e, tl.trans(k_e.to(q_e.dtype)), input_precision=PREC)
            qk = tl.dot(q_o, tl.trans(k_o.to(q_e.dtype)), qk, input_precision=PREC)
            qk = tl.where(rlive[None, :], qk * qk_scale, float("-inf"))
            acc, m_i, l_i = softmax_pv(qk, v.to(q_e.dtype), 1.0, acc, m_i, l_i, 0, False, False,
                                          PREC, False)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if SINGLE:
            orow = OUT + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :]
            tl.store(orow, o.to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:  # the merge kernel's layout: row (b * Hq + head) * splits + s, base-2 lse
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + h * G + g) * num_splits + s
            tl.store(OP + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    expose_for_interpreter(globals(), locals())
    return _int4_decode_kernel
