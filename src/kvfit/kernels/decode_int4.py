"""Paged decode attention over the int4 pool (Triton): packed 4-bit pages + the residual page.

One query token per request. Program (b, h) loads the G query heads that share KV head h (padded
to 16 rows for ``tl.dot``), walks request b's full pages (32 tokens each, one K quantization
group) and then its full-precision residual page (``kv_len % 32`` tokens), with an online
softmax in float32 (base-2 logits). Everything is dequantized in registers:

* K page ``[32, D/2]`` bytes: the low nibbles are the even channels, the high nibbles the odd
  ones, so the query is loaded as its even and odd halves and the logits are
  ``q_even . K_even + q_odd . K_odd`` (no interleave); K's per-channel scale and zero
  (``[D]`` per page) dequantize the codes, ``code * scale + zero``.
* V page: per token and 32-channel group scale/zero; the output is accumulated as its even and
  odd halves and stored interleaved.

Split-K: program (b, h, s) covers split s of the request's full pages (the last split also the
residual page); with more than one split the decode merge kernel of ``decode_kernels`` combines
the partial outputs by their base-2 log-sum-exp. The grid depends only on (batch, kv heads,
splits): no host syncs. Owns nothing; writes ``out`` (and the split scratch).
"""

from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634


@functools.cache
def build():
    """The jitted kernel, built once per process on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _int4_decode_kernel(Q, OUT, OP, LSE, KC, VC, KS, KZ, VS, VZ, KR, VR, BT, KVLEN, RSLOT,
                            stride_qb, stride_qh, stride_ob, stride_oh,
                            stride_cp, stride_ch, stride_kp, stride_kh, stride_vp, stride_vh,
                            stride_rs, stride_rh, stride_bt, qk_scale, num_splits,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr, SINGLE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        HALF: tl.constexpr = D // 2
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, HALF)  # channel pair j: channels 2j (low nibble) and 2j + 1 (high)
        t = tl.arange(0, PAGE)
        gmask = g < G
        qrow = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh
        q_e = tl.load(qrow + 2 * j[None, :], mask=gmask[:, None], other=0.0).to(DOT_DTYPE)
        q_o = tl.load(qrow + 2 * j[None, :] + 1, mask=gmask[:, None], other=0.0).to(DOT_DTYPE)
        kv_len = tl.load(KVLEN + b)
        nfull = kv_len // PAGE
        tail = kv_len - nfull * PAGE
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc_e = tl.zeros([G_PAD, HALF], tl.float32)
        acc_o = tl.zeros([G_PAD, HALF], tl.float32)
        per = (nfull + num_splits - 1) // num_splits  # full pages per split
        p0 = s * per
        p1 = tl.minimum(p0 + per, nfull)
        for p in range(p0, p1):
            page = tl.load(BT + b * stride_bt + p).to(tl.int64)
            cbase = page * stride_cp + h * stride_ch + t[:, None] * HALF + j[None, :]
            kb = tl.load(KC + cbase)  # [PAGE, D/2] uint8
            vb = tl.load(VC + cbase)
            kbase = KS + page * stride_kp + h * stride_kh + 2 * j
            zbase = KZ + page * stride_kp + h * stride_kh + 2 * j
            ks_e = tl.load(kbase).to(tl.float32)
            ks_o = tl.load(kbase + 1).to(tl.float32)
            kz_e = tl.load(zbase).to(tl.float32)
            kz_o = tl.load(zbase + 1).to(tl.float32)
            k_e = (kb & 15).to(tl.float32) * ks_e[None, :] + kz_e[None, :]
            k_o = (kb >> 4).to(tl.float32) * ks_o[None, :] + kz_o[None, :]
            qk = tl.dot(q_e, tl.trans(k_e.to(DOT_DTYPE)))
            qk += tl.dot(q_o, tl.trans(k_o.to(DOT_DTYPE)))  # [G_PAD, PAGE]
            qk = qk * qk_scale
            # V: one scale/zero per token and 32 channels; pair j lies in group j // 16
            voff = page * stride_vp + h * stride_vh + t[:, None] * (D // 32) + (j // 16)[None, :]
            vs = tl.load(VS + voff).to(tl.float32)
            vz = tl.load(VZ + voff).to(tl.float32)
            v_e = (vb & 15).to(tl.float32) * vs + vz
            v_o = (vb >> 4).to(tl.float32) * vs + vz
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # online softmax, base 2
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            pd = pr.to(DOT_DTYPE)
            acc_e = acc_e * alpha[:, None] + tl.dot(pd, v_e.to(DOT_DTYPE))
            acc_o = acc_o * alpha[:, None] + tl.dot(pd, v_o.to(DOT_DTYPE))
            m_i = m_new
        if (tail > 0) & (s == num_splits - 1):  # the partial page, full precision (residual)
            slot = tl.load(RSLOT + b).to(tl.int64)
            live = t < tail
            rbase = slot * stride_rs + h * stride_rh + t[:, None] * D + 2 * j[None, :]
            k_e = tl.load(KR + rbase, mask=live[:, None], other=0.0)
            k_o = tl.load(KR + rbase + 1, mask=live[:, None], other=0.0)
            v_e = tl.load(VR + rbase, mask=live[:, None], other=0.0)
            v_o = tl.load(VR + rbase + 1, mask=live[:, None], other=0.0)
            qk = tl.dot(q_e, tl.trans(k_e.to(DOT_DTYPE)))
            qk += tl.dot(q_o, tl.trans(k_o.to(DOT_DTYPE)))
            qk = tl.where(live[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # online softmax, base 2
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            pd = pr.to(DOT_DTYPE)
            acc_e = acc_e * alpha[:, None] + tl.dot(pd, v_e.to(DOT_DTYPE))
            acc_o = acc_o * alpha[:, None] + tl.dot(pd, v_o.to(DOT_DTYPE))
            m_i = m_new
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o_e = acc_e / safe_l[:, None]
        o_o = acc_o / safe_l[:, None]
        if SINGLE:
            orow = OUT + b * stride_ob + (h * G + g)[:, None] * stride_oh + 2 * j[None, :]
            tl.store(orow, o_e.to(OUT.dtype.element_ty), mask=gmask[:, None])
            tl.store(orow + 1, o_o.to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:  # the merge kernel's layout: row (b * Hq + head) * splits + s, base-2 lse
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (b * (tl.num_programs(1) * G) + h * G + g) * num_splits + s
            prow = OP + row[:, None] * D + 2 * j[None, :]
            tl.store(prow, o_e, mask=gmask[:, None])
            tl.store(prow + 1, o_o, mask=gmask[:, None])
            tl.store(LSE + row, lse, mask=gmask)

    return _int4_decode_kernel


def choose_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int = 132) -> int:
    """Splits of the context so that about two programs run per SM, each over >= 8 pages."""
    programs = batch * num_kv_heads
    most = max(1, max_kv_len // (8 * 32))
    return max(1, min(most, -(-2 * num_sms // programs)))


def int4_decode(q: torch.Tensor, pool, layer_id: int, block_table: torch.Tensor,
                kv_lens: torch.Tensor, residual_slots: torch.Tensor, out: torch.Tensor,
                sm_scale: float, num_splits: int = 1, num_warps: int = 4,
                num_stages: int = 2) -> torch.Tensor:
    """q ``[B, Hq, D]`` over layer ``layer_id`` of an ``Int4KVCache`` -> ``out [B, Hq, D]``.

    ``block_table [B, max_pages]`` int32, ``kv_lens [B]`` int32 (tokens cached, including the
    residual's), ``residual_slots [B]`` int32 (each request's slot), ``num_splits`` of the
    context (``choose_splits``). Writes ``out``.
    """
    import triton
    import triton.language as tl

    b, hq, d = q.shape
    kc, vc = pool.k_caches[layer_id], pool.v_caches[layer_id]
    ks, kz = pool.k_scale_caches[layer_id], pool.k_zero_caches[layer_id]
    vs, vz = pool.v_scale_caches[layer_id], pool.v_zero_caches[layer_id]
    kr, vr = pool.k_residual[layer_id], pool.v_residual[layer_id]
    hkv = kc.shape[1]
    group = hq // hkv
    # float16 products for 16-bit queries (as the fp8 kernels: 11-bit mantissa, K up to ~220 in
    # real models is far inside its range); float32 when the query or the residual is float32
    dot = tl.float32 if torch.float32 in (q.dtype, kr.dtype) else tl.float16
    single = num_splits == 1
    if single:
        op = lse = out  # unused
    else:
        op = torch.empty((b * hq * num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b * hq * num_splits,), dtype=torch.float32, device=q.device)
    build()[(b, hkv, num_splits)](
        q, out, op, lse, kc, vc, ks, kz, vs, vz, kr, vr, block_table, kv_lens, residual_slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        kr.stride(0), kr.stride(1), block_table.stride(0), sm_scale * LOG2E, num_splits,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, PAGE=pool.page_size,
        DOT_DTYPE=dot, SINGLE=single, num_warps=num_warps, num_stages=num_stages)
    if not single:
        from kvfit.kernels.decode_kernels import build as build_decode

        merge = build_decode()[1]
        merge[(b, hq)](op, lse, out, 1.0, out.stride(0), out.stride(1), num_splits, hq, D=d,
                       S_PAD=triton.next_power_of_2(num_splits), num_warps=4 if d >= 128 else 2)
    return out
