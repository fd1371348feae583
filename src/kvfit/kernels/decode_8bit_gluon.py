"""The 8-bit (fp8_e4m3, fp8_e5m2, int8) paged decode written in Gluon for Hopper: each tile's
codes are converted once into float16 shared-memory tiles and both products run on warp-group
MMAs, as the int4 kernel of ``decode_int4_gluon`` does.

Why. The Triton decode converts 8-bit tiles into the MMA operands' register layouts. For fp8 on
128-d heads that reads at the copy bandwidth, but int8 (1.13x fp8's time on Qwen3 heads) and
64-d heads (fp8 2.8-3.4 TB/s, int8 2.5-3.0) stay short of it (docs/benchmarks.md, "8-bit
decode"), and the int4 Gluon kernel, which converts into shared memory, ran 1.35x faster than
the Triton fp8 decode on 64-d heads. A tile's path here:

    K [pages, P, D], V token-minor [D, pages, P] codes --cp.async--> stage[i % STAGES]
    K codes --cvt (fp8) or prmt/sub (int8)--> kt [64, D] float16
    V codes --the same--> vt [D, 64] float16 (dead tokens of a partial tile zeroed)
    s^T [64, H] = kt . q^T            (warp-group MMAs; q in shared memory all along)
    int8: s^T rows times their token's K scale; p^T rows times their V scale before P.V
    o^T [D, H] += vt . p^T

A tile is 64 tokens (64 / P pages; pages of 16, 32 or 64). Heads are the MMAs' N (the query
group, padded to ``BLOCK_H`` >= 8), tokens their M. The fp8 per-tensor K scale is folded into
the query's softmax scale, the V scale applied to the output (``v_out``; the merge applies it
to a split launch). int8 pages carry float16 scales per (page, KV head, token).

Grid ``(batch, kv heads, splits)``; one split writes ``OUT``, several write float32 partials
``OP`` (rows ``(b * Hq + head) * splits + s``) and base-2 log-sum-exp ``LSE`` for
``decode_kernels``' merge; the context is cut into splits as the Triton kernels cut it
(``decode_common._split_span``: whole 64-token tiles), an empty split exits at once and the
merge counts the live ones. No window, soft-cap or q bias (the Triton kernel
serves those). Owns nothing.
"""
from __future__ import annotations

import functools
import logging

import torch

# int8 -> float16, four values an asm: bias each byte by 128 (xor), put it under the float16
# exponent of 1024 (prmt: 0x64XX = 1024 + XX exactly), subtract 1152 = 1024 + 128
I8_TO_F16_ASM = ("{\n.reg .b32 a, lo, hi, c;\nxor.b32 a, $2, 0x80808080;\n"
                 "prmt.b32 lo, a, 0x64646464, 0x4140;\nprmt.b32 hi, a, 0x64646464, 0x4342;\n"
                 "mov.b32 c, 0x64806480;\nsub.f16x2 $0, lo, c;\nsub.f16x2 $1, hi, c;\n}\n")


@functools.cache
def build():
    """The jitted Gluon kernel, built once per process on first use (CUDA, sm_90)."""
    from triton.experimental import gluon
    from kvfit.kernels.gluon_hopper import hopper_names

    # Triton's JIT resolves the kernels' names in this module's globals
    globals().update(hopper_names())
    globals().update(_I8_ASM=gl.constexpr(I8_TO_F16_ASM))  # noqa: F821

    @gluon.jit
    def _to_f16(x, INT8: gl.constexpr):
        # 8-bit codes -> float16, exactly (int8 by asm: no I2F, a quarter-rate unit)
        if INT8:
            y = gl.inline_asm_elementwise(_I8_ASM, "=r,=r,r", [x],  # noqa: F821
                                          dtype=gl.float16, is_pure=True, pack=4)
        else:
            y = x.to(gl.float16)
        return y

    @gluon.jit
    def _issue(stage_k, stage_v, KCh, VCh, bt_row, t0, n1, stride_cp, D: gl.constexpr,
               PAGE: gl.constexpr, NPG: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr):
        # one commit group of cp.async for the tile's pages from token t0 (pages from n1 on
        # zero-filled, never read): K [NPG, PAGE, D], V [D, NPG, PAGE] (its pages' [D, PAGE]
        # rows side by side)
        LK2: gl.constexpr = gl.SliceLayout(2, LK)
        fk = t0 + PAGE * gl.arange(0, NPG, layout=gl.SliceLayout(1, LK2))  # pages' first tokens
        pgk = gl.load(bt_row + fk // PAGE, mask=fk < n1, other=0).to(gl.int64)
        tk = gl.arange(0, PAGE, layout=gl.SliceLayout(0, LK2))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK)))
        rowk = (pgk * stride_cp)[:, None] + (tk * D)[None, :]  # [NPG, PAGE]
        _cp_async(stage_k, KCh + rowk[:, :, None] + c[None, None, :],  # noqa: F821
                  mask=(fk < n1)[:, None, None])
        LV0: gl.constexpr = gl.SliceLayout(0, LV)
        fv = t0 + PAGE * gl.arange(0, NPG, layout=gl.SliceLayout(1, LV0))
        pgv = gl.load(bt_row + fv // PAGE, mask=fv < n1, other=0).to(gl.int64)
        tv = gl.arange(0, PAGE, layout=gl.SliceLayout(0, LV0))
        dv = gl.arange(0, D, layout=gl.SliceLayout(1, gl.SliceLayout(2, LV)))
        colv = (pgv * stride_cp)[:, None] + tv[None, :]  # [NPG, PAGE]
        _cp_async(stage_v, VCh + (dv * PAGE)[:, None, None] + colv[None, :, :],  # noqa: F821
                  mask=(fv < n1)[:, None][None, :, :])
        async_copy.commit_group()  # noqa: F821

    @gluon.jit
    def _token_scales(KS, VS, bt_row, t0, n1, s_head, stride_sp, BLOCK_N: gl.constexpr,
                      PAGE: gl.constexpr, L: gl.constexpr):
        # int8: the K and V scales of the tile's tokens ([BLOCK_N] float32 in layout L, 0 for
        # tokens from n1 on)
        tok = t0 + gl.arange(0, BLOCK_N, layout=L)
        live = tok < n1
        pg = gl.load(bt_row + tok // PAGE, mask=live, other=0).to(gl.int64)
        off = pg * stride_sp + s_head + tok % PAGE
        return (gl.load(KS + off, mask=live, other=0.0).to(gl.float32),
                gl.load(VS + off, mask=live, other=0.0).to(gl.float32))

    @gluon.jit
    def _convert(stage_k, stage_v, kt, vt, n_live, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 INT8: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr):
        # a stage into the float16 tiles; V's columns from n_live on are zeroed when the tile
        # is partial (the last page's unwritten tokens may hold any bits, NaN included, and
        # 0 * NaN would reach the output; K's are masked in the logits)
        k = _to_f16(stage_k.load(LK), INT8)  # [NPG, PAGE, D]
        kt.store(gl.reshape(k, [BLOCK_N, D]))
        v = gl.reshape(_to_f16(stage_v.load(LV), INT8), [D, BLOCK_N])  # [D, NPG, PAGE] -> [D, 64]
        if n_live < BLOCK_N:
            LV2: gl.constexpr = v.type.layout
            col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LV2))
            v = gl.where((col < n_live)[None, :], v, 0.0)
        vt.store(v)

    @gluon.jit
    def _attend(kt, vt, qs, p_s, acc, m_i, l_t, n_live, ks, vs, BLOCK_H: gl.constexpr,
                INT8: gl.constexpr, MMA: gl.constexpr):
        # one tile: s^T = kt . q^T (the query holds the base-2 softmax scale), int8 rows times
        # their K scale; rows >= n_live weigh 0; the online softmax; o^T += vt . p^T, int8 p
        # rows times their V scale. The running sum stays per row of the tile (l_t [64,
        # BLOCK_H]), summed once at the end: no cross-warp reduction for it per tile
        zero = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        s_t = warpgroup_mma(kt, qs.permute((1, 0)), zero, use_acc=False,  # noqa: F821
                            is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))  # noqa: F821
        if INT8:
            s_t = s_t * ks[:, None]
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        s_t = gl.where((r < n_live)[:, None], s_t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p_t = gl.exp2(s_t - m_use[None, :])
        l_t = l_t * alpha[None, :] + p_t
        if INT8:
            p_t = p_t * vs[:, None]
        p_s.store(p_t.to(gl.float16))
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821
        acc = warpgroup_mma(vt, p_s, acc * alpha[None, :], is_async=True)  # noqa: F821
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # noqa: F821
        return acc, m_new, l_t

    @gluon.jit
    def _decode_8bit_gluon(Q, OUT, OP, LSE, KC, VC, KS, VS, BT, KVLEN,
                           stride_qb, stride_qh, stride_ob, stride_oh, stride_cp, stride_ch,
                           stride_sp, stride_sh, stride_bt, qk_scale, v_out, num_splits,
                           G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,
                           PAGE: gl.constexpr, STAGES: gl.constexpr, INT8: gl.constexpr,
                           SINGLE: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(num_warps == 4, "one warp group")
        gl.static_assert(64 % PAGE == 0, "pages of 16, 32 or 64 tokens")
        b = gl.program_id(0)
        h = gl.program_id(1)
        s = gl.program_id(2)
        BLOCK_N: gl.constexpr = 64  # tokens a tile: the logits MMAs' M
        NPG: gl.constexpr = BLOCK_N // PAGE
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        # K codes [NPG, PAGE, D]: 16 bytes a thread along a row; V codes [D, NPG, PAGE]: 16
        # bytes a thread along a page's tokens, the 64 tokens of a channel in 4 threads
        TD: gl.constexpr = D // 16 if D // 16 <= 32 else 32
        WP: gl.constexpr = NPG if NPG <= 4 else 4
        LK: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 // TD, TD], [WP, 4 // WP, 1],
                                            [2, 1, 0])
        LV: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, NPG, PAGE // 16], [4, 1, 1],
                                            [2, 1, 0])
        # the query [BLOCK_H, D] (float32), SPQ values a thread
        SPQ: gl.constexpr = 8 if BLOCK_H * D >= 1024 else BLOCK_H * D // 128
        TPC: gl.constexpr = 32 if D // SPQ >= 32 else D // SPQ
        LQ: gl.constexpr = gl.BlockedLayout([1, SPQ], [32 // TPC, TPC], [4, 1], [1, 0])
        LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        RAW3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        stage_k = gl.allocate_shared_memory(KC.dtype.element_ty, [STAGES, NPG, PAGE, D], RAW3)
        stage_v = gl.allocate_shared_memory(VC.dtype.element_ty, [STAGES, D, NPG, PAGE], RAW3)
        kt = gl.allocate_shared_memory(
            gl.float16, [BLOCK_N, D], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D],
                                                                           gl.float16))
        vt = gl.allocate_shared_memory(
            gl.float16, [D, BLOCK_N], gl.NVMMASharedLayout.get_default_for([D, BLOCK_N],
                                                                           gl.float16))
        qs = gl.allocate_shared_memory(
            gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D],
                                                                           gl.float16))
        p_s = gl.allocate_shared_memory(
            gl.float16, [BLOCK_N, BLOCK_H],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16))

        # the query group [BLOCK_H, D] times the base-2 softmax scale (the MMAs' logits come out
        # scaled), in shared memory for the whole program (the first tile's barrier and fence
        # publish it)
        hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LQ))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        qptr = Q + b.to(gl.int64) * stride_qb + (h * G + hq)[:, None] * stride_qh + cq[None, :]
        q = gl.load(qptr, mask=(hq < G)[:, None], other=0.0).to(gl.float32) * qk_scale
        qs.store(q.to(gl.float16))

        # split s: tokens [n0, n1), whole tiles
        kv_len = gl.load(KVLEN + b)
        per = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        n0 = s * per
        n1 = gl.minimum(n0 + per, kv_len)
        n_tiles = gl.cdiv(gl.maximum(n1 - n0, 0), BLOCK_N)
        if not SINGLE:
            if n_tiles == 0:  # an empty split writes nothing: the merge counts the live ones
                return
        bt_row = BT + b.to(gl.int64) * stride_bt
        KCh = KC + h * stride_ch
        VCh = VC + h * stride_ch
        s_head = h * stride_sh
        LR: gl.constexpr = gl.SliceLayout(1, MMA)

        for t in gl.static_range(STAGES - 1):
            _issue(stage_k.index(t), stage_v.index(t), KCh, VCh, bt_row, n0 + BLOCK_N * t, n1,
                   stride_cp, D, PAGE, NPG, LK, LV)
        ks = qk_scale  # int8: the tile's token scales, loaded into registers a tile ahead
        vs = qk_scale
        if INT8:
            ks, vs = _token_scales(KS, VS, bt_row, n0, n1, s_head, stride_sp, BLOCK_N, PAGE, LR)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_t = gl.zeros([64, BLOCK_H], gl.float32, layout=MMA)
        acc = gl.zeros([D, BLOCK_H], gl.float32, layout=MMA)
        for i in range(n_tiles):
            t0 = n0 + BLOCK_N * i
            _cta_barrier()  # noqa: F821 -- the last tile's MMAs and reads are done everywhere
            j = i + STAGES - 1
            _issue(stage_k.index(j % STAGES), stage_v.index(j % STAGES), KCh, VCh, bt_row,
                   n0 + BLOCK_N * j, n1, stride_cp, D, PAGE, NPG, LK, LV)
            ks_c = ks
            vs_c = vs
            if INT8:  # the next tile's scales
                ks, vs = _token_scales(KS, VS, bt_row, t0 + BLOCK_N, n1, s_head, stride_sp,
                                       BLOCK_N, PAGE, LR)
            async_copy.wait_group(STAGES - 1)  # noqa: F821 -- this thread's copies of tile i
            _cta_barrier()  # noqa: F821 -- and every thread's
            n_live = gl.minimum(n1 - t0, BLOCK_N)
            cur = i % STAGES
            _convert(stage_k.index(cur), stage_v.index(cur), kt, vt, n_live, BLOCK_N, D, INT8,
                     LK, LV)
            fence_async_shared()  # noqa: F821
            _cta_barrier()  # noqa: F821
            acc, m_i, l_t = _attend(kt, vt, qs, p_s, acc, m_i, l_t, n_live, ks_c, vs_c, BLOCK_H,
                                    INT8, MMA)
        async_copy.wait_group(0)  # noqa: F821

        # o^T = acc [D, BLOCK_H] / l
        l_i = gl.sum(l_t, axis=0)
        safe_l = gl.where(l_i > 0, l_i, 1.0)
        o_t = gl.convert_layout(acc / safe_l[None, :], LO)
        d = gl.arange(0, D, layout=gl.SliceLayout(1, LO))
        g = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LO))
        omask = (g < G)[None, :] & (d < D)[:, None]
        if SINGLE:
            dst = OUT + b.to(gl.int64) * stride_ob + (h * G + g)[None, :] * stride_oh
            gl.store(dst + d[:, None], (o_t * v_out).to(OUT.dtype.element_ty), mask=omask)
        else:
            hkv = gl.num_programs(1)
            orow = (b.to(gl.int64) * (hkv * G) + h * G + g) * num_splits + s  # [BLOCK_H]
            gl.store(OP + orow[None, :] * D + d[:, None], o_t, mask=omask)
            lse = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
            gh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))
            lrow = (b.to(gl.int64) * (hkv * G) + h * G + gh) * num_splits + s
            gl.store(LSE + lrow, lse, mask=gh < G)

    return _decode_8bit_gluon


# ---------------------------------------------------------------------------------------------
# host side

log = logging.getLogger("kvfit")
# the launch per head size: (stages, programs per SM in the split rule, register cap)
GLUON_TILES = {64: (3, 4, None), 128: (3, 2, None), 256: (2, 1, None)}
# (page dtype kind, head size) pairs whose decode runs this kernel by default on Hopper with
# 16-bit queries (the triton backend's choice; docs/benchmarks.md)
DEFAULT_ON: frozenset = frozenset()
_failures: list[str] = []  # the first compile failure of the kernel in this process, if any


def kind(cache_dtype: torch.dtype) -> str | None:
    """"fp8", "int8" or None (a page dtype this kernel does not read)."""
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return "int8" if cache_dtype == torch.int8 else None


def fits(cache_dtype: torch.dtype, q_dtype: torch.dtype, head_dim: int, page_size: int,
         v_t: bool, softcap=None, window=None) -> str | None:
    """None when a decode of these pages can run this kernel, else the reason it cannot."""
    if kind(cache_dtype) is None:
        return f"{cache_dtype} pages (it reads fp8_e4m3, fp8_e5m2 and int8)"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"{q_dtype} queries (it takes 16-bit ones)"
    if head_dim not in GLUON_TILES:
        return f"head_dim {head_dim} (it takes {sorted(GLUON_TILES)})"
    if page_size not in (16, 32, 64):
        return f"pages of {page_size} tokens (it takes 16, 32 or 64)"
    if not v_t:
        return "HND V pages (it reads token-minor V, the pool's v_layout 'HDN')"
    if softcap is not None or window is not None:
        return "a soft-cap or a sliding window"
    return None


def available(device=None) -> bool:
    """A Hopper GPU with Gluon's Hopper module, and no compile failure in this process."""
    from kvfit.kernels.mla_gluon import gluon_available

    if _failures or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    return gluon_available(index)


def launch_args(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, qk_scale: float,
                v_out: float, stages: int, num_splits: int, scale_caches=None):
    """(grid, positional args, constexprs) of one launch; ``scale_caches`` (K's, V's float16
    ``[pages, Hkv, P]``) for int8 pages, ``qk_scale`` the base-2 softmax scale (times fp8's
    per-tensor K scale), ``v_out`` fp8's V scale for a single split's output (1 otherwise)."""
    import triton

    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    ks, vs = scale_caches if int8 else (k_cache, k_cache)
    args = (q, out, op, lse, k_cache, v_cache, ks, vs, block_table, kv_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
            k_cache.stride(1), ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
            block_table.stride(0), float(qk_scale), float(v_out), num_splits)
    consts = dict(G=hq // hkv, BLOCK_H=max(8, triton.next_power_of_2(hq // hkv)), D=d,
                  PAGE=k_cache.shape[2], STAGES=stages, INT8=int8, SINGLE=num_splits == 1,
                  num_warps=4)
    return (b, hkv, num_splits), args, consts


def launch(q, k_cache, v_cache, block_table, kv_lens, out, op, lse, qk_scale: float,
           v_out: float, stages: int, num_splits: int, maxnreg: int | None = None,
           scale_caches=None) -> bool:
    """One launch: True when it ran, False when this Triton cannot compile the kernel (logged
    once, nothing written: the caller runs the Triton kernel)."""
    from kvfit.kernels.mla_gluon import _compile_errors

    grid, args, consts = launch_args(q, k_cache, v_cache, block_table, kv_lens, out, op, lse,
                                     qk_scale, v_out, stages, num_splits, scale_caches)
    if maxnreg:
        consts["maxnreg"] = maxnreg
    try:
        build()[grid](*args, **consts)
    except _compile_errors() as e:
        import triton

        _failures.append(f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        log.warning("the Gluon 8-bit decode kernel does not compile with Triton %s (%s); 8-bit "
                    "decode runs the Triton kernel. Triton 3.6 is known to work.",
                    triton.__version__, _failures[0])
        return False
    return True
