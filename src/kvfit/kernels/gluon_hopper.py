"""What the Hopper Gluon kernels share (``mla_decode_gluon``, ``decode_int4_gluon``,
``decode_int4_regs_kernel``, ``decode_8bit_gluon_kernel``): the Gluon names they use, resolved
once for the installed Triton (``hopper_names``); the MHA decodes' tile token numbering and k
relabelling, online-softmax step, P.V step and split epilogue (``mha_decode_parts``); whether
they can run here (``gluon_available``); which exceptions mean that the installed Triton
cannot compile one (``compile_errors``); and the launch that records such a failure and logs it
once (``launch_or_record``: the hosts then run the Triton kernels).

Some names moved between Triton releases: cp.async of a pointer tile into shared memory is
``async_load`` from Triton 3.7 on (the old name raises there), ``async_copy_global_to_shared``
before; the CTA barrier is ``gl.barrier`` from 3.7 on, ``gl.thread_barrier`` before. A kernel
module puts these names into its globals before defining its ``gluon.jit`` functions, because
Triton's JIT resolves the names a kernel uses in its module's globals. Owns nothing.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("kvfit")


@functools.cache
def gluon_available(device_index: int = 0) -> bool:
    """Whether the Gluon kernels can run here: a Hopper GPU (sm_90: ``wgmma``) and a Triton
    with Gluon's Hopper module; not under Triton's CPU interpreter. Cached per device."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def compile_errors() -> tuple:
    """The exceptions that mean "this Triton cannot build the kernel" (not a bad launch)."""
    errors: list = [ImportError, AttributeError, TypeError, NotImplementedError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        errors += [CompilationError, OutOfResources]
    except ImportError:
        pass
    return tuple(errors)


def launch_or_record(launch, failures: list, kernel: str, fallback: str,
                     known: str = "3.6") -> bool:
    """Runs ``launch()``: True when it ran; False when the installed Triton cannot compile the
    kernel. The failure is appended to ``failures`` (the host's record, which turns the kernel
    off for the process) and the first one is logged as a warning naming ``kernel``, what runs
    instead (``fallback``) and the Triton releases ``known`` to work. Other errors propagate."""
    try:
        launch()
    except compile_errors() as e:
        import triton

        failures.append(f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        if len(failures) == 1:
            log.warning("the %s does not compile with Triton %s (%s); %s. Triton %s is known to "
                        "work.", kernel, triton.__version__, failures[0], fallback, known)
        return False
    return True


def hopper_names() -> dict:
    """``gl``, ``async_copy``, ``fence_async_shared``, ``warpgroup_mma``,
    ``warpgroup_mma_wait``, ``_cp_async`` and ``_cta_barrier`` for the installed Triton
    (imports Gluon; CUDA builds only)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    return dict(
        gl=gl, async_copy=async_copy, fence_async_shared=fence_async_shared,
        warpgroup_mma=warpgroup_mma, warpgroup_mma_wait=warpgroup_mma_wait,
        _cp_async=getattr(async_copy, "async_load", None)
        or async_copy.async_copy_global_to_shared,
        _cta_barrier=getattr(gl, "barrier", None) or gl.thread_barrier)


@functools.cache
def mha_decode_parts() -> dict:
    """The jitted pieces the int4 and 8-bit Gluon decodes share (one program: a request, a KV
    head, a split; tokens as the logits MMAs' M, heads as their N), by the names the kernels
    call them; built once per process (imports Gluon), a kernel module puts them into its
    globals.

    ``_online_softmax(s_t, m_i, l_t)``: one tile's base-2 logits ``s_t [T, BLOCK_H]`` (dead
    rows -inf) against the running max ``m_i [BLOCK_H]`` -> (new max, the rescale ``alpha`` of
    the accumulator, ``p_t``, the per-row running sums ``l_t [T, BLOCK_H]`` rescaled and
    added: summed over the rows once, at the end, so no cross-warp reduction per tile).

    ``_tile_max(s_t, mx_s, MMA, EXCHANGE)``: the maximum down the rows of ``s_t [T,
    BLOCK_H]``; ``EXCHANGE``: through a ``[4, BLOCK_H]`` float32 shared buffer and one barrier
    (the same value as ``gl.max(s_t, axis=0)``, bit for bit; the buffer is rewritten every
    tile: a barrier must separate a tile's reads of it from the next tile's writes, e.g.
    ``_pv_step``'s). ``_online_softmax_to(s_t, m_i, l_t, m_tile)``: ``_online_softmax`` with
    the tile's maximum given.

    ``_pv_step(p_t, vt, p_s, acc, alpha, ORDERED=False)``: P [T, BLOCK_H] through the shared
    tile ``p_s`` (after a barrier: the last tile's P.V has read it everywhere; ``ORDERED``: a
    barrier since then already, e.g. ``_tile_max``'s) and ``acc * alpha + vt . p``
    (warp-group MMA, A = V^T from registers), waited.

    ``_split_out(...)``: the epilogue, ``acc [D, BLOCK_H]`` (o^T, float32, MMA layout) over
    ``l_t`` summed. One split writes ``OUT`` rows ``b, h * G + g`` (times ``v_out``, in OUT's
    dtype); several write float32 partials ``OP`` (rows ``(b * Hq + head) * splits + s``) and
    their base-2 log-sum-exp ``LSE`` (-inf for an empty split) for ``decode_kernels``' merge.
    ``CHMAP``: which channel acc's row r holds: 0 channel r; 1 the even channels, then the odd
    ones (the shared-memory int4 kernel's order); 2 ``_thread_rows_channel(r, D)``.

    ``_tile_token(m, TOK)``: the tile's token at row m (of the logits, of P, and P.V's k):
    ``(TOK/4) c + 4 ks + 2 b3 + b0`` for m = 16 ks + 8 b3 + 2 c + b0, so that a thread's share
    of P.V's k is TOK/4 contiguous tokens (the operand relabelling of the register kernels).

    ``_k_order(x, R, C)``: x ``[R, C]`` in physical column order -> the float16 MMA's k order
    (a reshape and permute, in whatever layout they give): column ``4 ks + 2 b3 + b0 + (C/4) c``
    becomes k = 16 ks + 8 b3 + 2 c + b0. ``_hw_k(x, R, C, LA)``: that, in layout LA (checked to
    move nothing).

    ``_thread_rows_channel(r, D)``: the channel ``(8 w + l) D/32 + 2 i + h`` at P.V's row
    r = 64 i + 16 w + 8 h + l, where each thread's rows are D/32 consecutive channels (the
    register int4 kernel's order, ``decode_int4_regs_layouts``).

    ``_l2_prefetch(addr)``: ask L2 for the 128-byte line holding each byte address of the int64
    tensor ``addr`` (``prefetch.global.L2``: fire and forget, no register waits for it)."""
    from triton.experimental import gluon

    globals().update(hopper_names())

    @gluon.jit
    def _tile_max(s_t, mx_s, MMA: gl.constexpr, EXCHANGE: gl.constexpr):  # noqa: F821
        # the maximum down the rows of s_t [T, H] (layout MMA: a warp-group MMA's accumulator,
        # warp w holding rows 64 i + 16 w .. + 15). EXCHANGE: each warp reduces its rows by
        # shuffles and writes its H maxima to mx_s [4, H] (float32), one barrier, every thread
        # takes its columns' four values; else Gluon's own reduction across warps (two
        # barriers and a second round of shuffles), mx_s unused
        if not EXCHANGE:
            return gl.max(s_t, axis=0)  # noqa: F821
        T: gl.constexpr = s_t.shape[0]  # noqa: F821
        H: gl.constexpr = s_t.shape[1]  # noqa: F821
        m_w = gl.max(gl.max(gl.reshape(s_t, [T // 64, 4, 16, H]), axis=2), axis=0)  # noqa: F821
        mx_s.store(m_w)
        _cta_barrier()  # noqa: F821
        # [4, H] with all four rows of a column in one thread, its columns as in MMA's
        L4: gl.constexpr = gl.BlockedLayout([4, 2], [8, 4], [4, 1], [1, 0])  # noqa: F821
        return gl.convert_layout(gl.max(mx_s.load(L4), axis=0),  # noqa: F821
                                 gl.SliceLayout(0, MMA))  # noqa: F821

    @gluon.jit
    def _online_softmax_to(s_t, m_i, l_t, m_tile):
        # _online_softmax with the tile's maximum m_tile [BLOCK_H] given
        m_new = gl.maximum(m_i, m_tile)  # noqa: F821
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # noqa: F821
        alpha = gl.exp2(m_i - m_use)  # noqa: F821
        p_t = gl.exp2(s_t - m_use[None, :])  # noqa: F821
        return m_new, alpha, p_t, l_t * alpha[None, :] + p_t

    @gluon.jit
    def _online_softmax(s_t, m_i, l_t):
        return _online_softmax_to(s_t, m_i, l_t, gl.max(s_t, axis=0))  # noqa: F821

    @gluon.jit
    def _tile_token(m, TOK: gl.constexpr):  # noqa: F821
        return ((m >> 1) & 3) * (TOK // 4) + (m >> 4) * 4 + ((m >> 3) & 1) * 2 + (m & 1)

    @gluon.jit
    def _k_order(x, R: gl.constexpr, C: gl.constexpr):  # noqa: F821
        y = gl.reshape(x, [R, 4, C // 16, 2, 2])  # noqa: F821
        return gl.reshape(gl.permute(y, (0, 2, 3, 1, 4)), [R, C])  # noqa: F821

    @gluon.jit
    def _hw_k(x, R: gl.constexpr, C: gl.constexpr, LA: gl.constexpr):  # noqa: F821
        return gl.convert_layout(_k_order(x, R, C), LA, assert_trivial=True)  # noqa: F821

    @gluon.jit
    def _thread_rows_channel(r, D: gl.constexpr):  # noqa: F821
        return (((r >> 4) & 3) * 8 + (r & 7)) * (D // 32) + (r >> 6) * 2 + ((r >> 3) & 1)

    @gluon.jit
    def _split_out(acc, l_t, m_i, OUT, OP, LSE, b, h, s, num_splits, stride_ob, stride_oh,
                   v_out, G: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr,  # noqa: F821
                   SINGLE: gl.constexpr, CHMAP: gl.constexpr,  # noqa: F821
                   MMA: gl.constexpr):  # noqa: F821
        LO: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])  # noqa: F821
        l_i = gl.sum(l_t, axis=0)  # noqa: F821
        safe_l = gl.where(l_i > 0, l_i, 1.0)  # noqa: F821
        o_t = gl.convert_layout(acc / safe_l[None, :], LO)  # noqa: F821
        r = gl.arange(0, D, layout=gl.SliceLayout(1, LO))  # noqa: F821
        if CHMAP == 1:
            ch = gl.where(r < D // 2, 2 * r, 2 * (r - D // 2) + 1)  # noqa: F821
        elif CHMAP == 2:
            ch = _thread_rows_channel(r, D)
        else:
            ch = r
        g = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LO))  # noqa: F821
        omask = (g < G)[None, :] & (r < D)[:, None]
        if SINGLE:
            dst = OUT + b.to(gl.int64) * stride_ob + (h * G + g)[None, :] * stride_oh  # noqa: F821
            gl.store(dst + ch[:, None], (o_t * v_out).to(OUT.dtype.element_ty),  # noqa: F821
                     mask=omask)
        else:
            hkv = gl.num_programs(1)  # noqa: F821
            orow = (b.to(gl.int64) * (hkv * G) + h * G + g) * num_splits + s  # noqa: F821
            gl.store(OP + orow[None, :] * D + ch[:, None], o_t, mask=omask)  # noqa: F821
            lse = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))  # noqa: F821
            gh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))  # noqa: F821
            lrow = (b.to(gl.int64) * (hkv * G) + h * G + gh) * num_splits + s  # noqa: F821
            gl.store(LSE + lrow, lse, mask=gh < G)  # noqa: F821

    @gluon.jit
    def _pv_step(p_t, vt, p_s, acc, alpha, ORDERED: gl.constexpr = False):  # noqa: F821
        if not ORDERED:  # (ORDERED: a barrier since the last tile's P.V, _tile_max's)
            _cta_barrier()  # noqa: F821 -- the last tile's P.V has read p_s everywhere
        p_s.store(p_t.to(gl.float16))  # noqa: F821
        fence_async_shared()  # noqa: F821
        _cta_barrier()  # noqa: F821
        acc = warpgroup_mma(vt, p_s, acc * alpha[None, :], is_async=True)  # noqa: F821
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # noqa: F821

    @gluon.jit
    def _l2_prefetch(addr):
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;",  # noqa: F821
                                  "=r,l", [addr], dtype=gl.int32, is_pure=False,  # noqa: F821
                                  pack=1)

    return dict(_online_softmax=_online_softmax, _online_softmax_to=_online_softmax_to,
                _tile_max=_tile_max, _split_out=_split_out, _pv_step=_pv_step,
                _tile_token=_tile_token, _k_order=_k_order, _hw_k=_hw_k,
                _thread_rows_channel=_thread_rows_channel, _l2_prefetch=_l2_prefetch)
