"""Paged MLA attention kernels (Triton) over the latent cache: the @triton.jit code behind
``kernels.mla``.

The cache of one layer is ``[num_pages, P, SLAB]`` with ``SLAB = RANK + ROPE`` (latent ``c``
then the rope key ``k_pe``; kvcache/mla.py). Weight-absorbed MLA is MQA with one shared
"head": query row ``[q_lat ; q_pe]`` scores ``q_lat . c + q_pe . k_pe`` and the value of a token
is its latent ``c`` itself, so one tile load of ``c`` feeds both MMAs (Q@C^T and P@C).

Rows of a program are (token, query head) pairs, heads fastest (row r -> token r // H, head
r % H): a decode program holds every head of its request (up to BLOCK_M of them), so each latent
tile is read once per (request, split) for all heads; a prefill program holds BLOCK_M / H
consecutive tokens of one request. Grid ``(programs, splits)``: split s walks its share of the
request's visible tokens (multiples of BLOCK_N) with an online softmax in float32 (base-2
logits, the latent scale folded into the softmax scale and applied to the output); with more
than one split the partial results and their log-sum-exp go to scratch and the decode merge
kernel (``decode_kernels``) combines them. fp8 latents are read as 16-bit words and become
float16 in registers (one packed ``cvt`` per word, ``_fp8_pairs_to_f16``) with the query cast to
float16: the converted tile then feeds both products as a 16-bit tile does (Q@C^T through
``ldmatrix``, P@C, which reduces over the tokens, through ``ldmatrix.trans``). Loaded as bytes,
the P@C operand of an 8-bit tile is gathered from shared memory one byte at a time (there is no
8-bit transposing load), with tokens 576 bytes apart: 16-way bank conflicts; that version ran at
12-20% of the copy bandwidth on the H200. 16-bit latents are loaded once and used as they are.

Kernels own nothing; they write ``OUT`` or the split scratch ``OP``/``LSE``.
"""

from __future__ import annotations

import functools


@functools.cache
def build():
    """The jitted (attention kernel, store kernel), built once per process on first use."""
    import triton
    import triton.language as tl

    globals().update(triton=triton, tl=tl)  # the Triton interpreter looks them up there

    from kvfit.kernels.store import build as build_store
    from kvfit.kernels.tile_math import build as build_tile_math

    shared = build_tile_math()
    # callees are module globals: the Triton interpreter (TRITON_INTERPRET=1, the CPU tests)
    # resolves names called from a kernel there, not in closures
    globals().update(softmax_pv=shared.softmax_pv, request_span=shared.request_span,
                     quant=build_store()[2])

    @triton.jit
    def _fp8_pairs_to_f16(w, E5M2: tl.constexpr, ASM: tl.constexpr):
        # w [N, D/2] uint16 words, two fp8 values each -> [N, D] float16 in registers (row
        # layout), so the P@C operand (reduced over the tokens: the tile transposed) is built
        # from float16 through ldmatrix.trans instead of byte-wise shared-memory gathers. ASM:
        # one packed cvt per word on the GPU; else (the interpreter) the same values by bytes.
        if ASM:
            if E5M2:
                lo, hi = tl.inline_asm_elementwise(
                    "{ .reg .b32 r; cvt.rn.f16x2.e5m2x2 r, $2; mov.b32 {$0, $1}, r; }",
                    "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
            else:
                lo, hi = tl.inline_asm_elementwise(
                    "{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; mov.b32 {$0, $1}, r; }",
                    "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            b0 = (w & 0xFF).to(tl.uint8)
            b1 = (w >> 8).to(tl.uint8)
            if E5M2:
                lo = b0.to(tl.float8e5, bitcast=True).to(tl.float16)
                hi = b1.to(tl.float8e5, bitcast=True).to(tl.float16)
            else:
                lo = b0.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                hi = b1.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return tl.reshape(tl.join(lo, hi), (w.shape[0], 2 * w.shape[1]))

    globals()["_fp8_pairs_to_f16"] = _fp8_pairs_to_f16

    @triton.jit
    def _tile(acc, m_i, l_i, qc, qr, n0, hi, qpos, C, bt_row, stride_cp, qk_scale,
              RANK: tl.constexpr, ROPE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
              SLAB: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
              F16: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
              PAIRS: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr):
        # tokens [n0, n0 + BLOCK_N): latent tile [BLOCK_N, DC] (= keys' first part and values),
        # rope tile [BLOCK_N, DR]; MASKED tiles cross hi or some row's causal diagonal
        n = n0 + tl.arange(0, BLOCK_N)
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        nmask = n < hi
        if MASKED:
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + n // PAGE).to(tl.int64)
        tok = C + page * stride_cp + (n % PAGE) * SLAB  # [BLOCK_N] pointers to the slabs
        if PAIRS:
            # 8-bit latents as 16-bit words, converted in registers (_fp8_pairs_to_f16): the
            # float16 tile then feeds both products like a 16-bit tile
            d2 = tl.arange(0, DC // 2)
            wptr = tok.to(tl.pointer_type(tl.uint16), bitcast=True)[:, None] + d2[None, :]
            if MASKED or DC != RANK:
                w = tl.load(wptr, mask=nmask[:, None] & (d2 < RANK // 2)[None, :], other=0)
            else:
                w = tl.load(wptr)
            kc = _fp8_pairs_to_f16(w, E5M2, ASM)  # noqa: F821  [BLOCK_N, DC]
        else:
            cmask = nmask[:, None]
            if DC != RANK:
                cmask = cmask & (dc < RANK)[None, :]
            if MASKED or DC != RANK:
                kc = tl.load(tok[:, None] + dc[None, :], mask=cmask, other=0.0)
            else:
                kc = tl.load(tok[:, None] + dc[None, :])
            kc = kc.to(qc.dtype)
        rmask = nmask[:, None] & (dr < ROPE)[None, :]
        if MASKED or DR != ROPE:
            kr = tl.load(tok[:, None] + RANK + dr[None, :], mask=rmask, other=0.0)
        else:
            kr = tl.load(tok[:, None] + RANK + dr[None, :])
        kr = kr.to(qc.dtype)
        qk = tl.dot(qc, tl.trans(kc), input_precision=PREC)  # [BLOCK_M, BLOCK_N]
        qk = tl.dot(qr, tl.trans(kr), qk, input_precision=PREC) * qk_scale
        vis = nmask[None, :] & (n[None, :] <= qpos[:, None])  # read only when MASKED
        return softmax_pv(qk, kc, 1.0, acc, m_i, l_i, vis, MASKED, False, PREC,  # noqa: F821
                          False)

    globals()["_tile"] = _tile

    @triton.jit
    def _mla_attn(Q, C, BT, CU, KVLEN, BLK, OUT, OP, LSE,
                  qk_scale, out_scale,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_bt,
                  num_splits,
                  H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, DC: tl.constexpr,
                  DR: tl.constexpr, SLAB: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HBLK: tl.constexpr,
                  DECODE: tl.constexpr, SINGLE: tl.constexpr, F16: tl.constexpr,
                  PREC: tl.constexpr, PAIRS: tl.constexpr, E5M2: tl.constexpr,
                  ASM: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.program_id(1)
        if DECODE:  # program = (request, block of heads): no block list needed (graphs)
            req = pid // HBLK
            row0 = (pid % HBLK) * BLOCK_M
        else:
            req = tl.load(BLK + 2 * pid)
            row0 = tl.load(BLK + 2 * pid + 1)
        q_start, q_len, prefix = request_span(CU, KVLEN, req)  # noqa: F821
        r = row0 + tl.arange(0, BLOCK_M)
        tok = r // H
        hq = r % H
        rows_live = tok < q_len
        qpos = prefix + tok  # [BLOCK_M] absolute positions
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        q_row = Q + (q_start + tok).to(tl.int64) * stride_qt + hq * stride_qh  # [BLOCK_M]
        qc = tl.load(q_row[:, None] + dc[None, :],
                     mask=rows_live[:, None] & (dc < RANK)[None, :], other=0.0)
        qr = tl.load(q_row[:, None] + RANK + dr[None, :],
                     mask=rows_live[:, None] & (dr < ROPE)[None, :], other=0.0)
        if F16:
            qc = qc.to(tl.float16)
            qr = qr.to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DC], tl.float32)
        first_tok = row0 // H
        last_tok = tl.minimum((row0 + BLOCK_M - 1) // H, q_len - 1)
        hi = prefix + last_tok + 1  # tokens the block's last row sees
        per = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
        lo = s * per
        hi = tl.minimum(lo + per, hi)
        # [lo, full_end): visible to every row, no masks; [full_end, hi): masked tiles
        diag = tl.minimum(prefix + first_tok + 1, hi)
        full_end = lo + tl.maximum(diag - lo, 0) // BLOCK_N * BLOCK_N
        bt_row = BT + req.to(tl.int64) * stride_bt
        for n0 in range(lo, full_end, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, qc, qr, n0, hi, qpos, C, bt_row, stride_cp,
                                  qk_scale, RANK, ROPE, DC, DR, SLAB, PAGE, BLOCK_N, F16, PREC,
                                  False, PAIRS, E5M2, ASM)
        for n0 in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, qc, qr, n0, hi, qpos, C, bt_row, stride_cp,
                                  qk_scale, RANK, ROPE, DC, DR, SLAB, PAGE, BLOCK_N, F16, PREC,
                                  True, PAIRS, E5M2, ASM)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        t_glob = (q_start + tok).to(tl.int64)
        dmask = rows_live[:, None] & (dc < RANK)[None, :]
        if SINGLE:
            tl.store(OUT + t_glob[:, None] * stride_ot + hq[:, None] * stride_oh + dc[None, :],
                     (o * out_scale).to(OUT.dtype.element_ty), mask=dmask)
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            row = (t_glob * H + hq) * num_splits + s  # [BLOCK_M] scratch rows
            tl.store(OP + row[:, None] * DC + dc[None, :], o, mask=dmask)
            tl.store(LSE + row, lse, mask=rows_live)

    @triton.jit
    def _store_latent(KV, C, SLOT, inv, max_finite, stride_kt, stride_cp,
                      SLAB: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                      QUANT: tl.constexpr, SCALED: tl.constexpr):
        # program t: slab kv[t] -> C[slot // P, slot % P, :] (quantized), slot < 0 skipped
        t = tl.program_id(0)
        slot = tl.load(SLOT + t)
        if slot < 0:
            return
        idx = tl.arange(0, BLOCK)
        mask = idx < SLAB
        x = tl.load(KV + t.to(tl.int64) * stride_kt + idx, mask=mask)
        y = quant(x, inv, max_finite, QUANT, SCALED)  # noqa: F821
        dst = C + (slot // PAGE) * stride_cp + (slot % PAGE) * SLAB + idx
        tl.store(dst, y.to(C.dtype.element_ty), mask=mask)

    return _mla_attn, _store_latent
