"""The Gluon names the Hopper kernels use (``mla_decode_gluon``, ``decode_int4_gluon``,
``decode_8bit_gluon_kernel``), resolved once for the installed Triton.

Some names moved between Triton releases: cp.async of a pointer tile into shared memory is
``async_load`` from Triton 3.7 on (the old name raises there), ``async_copy_global_to_shared``
before; the CTA barrier is ``gl.barrier`` from 3.7 on, ``gl.thread_barrier`` before. A kernel
module puts these names into its globals before defining its ``gluon.jit`` functions, because
Triton's JIT resolves the names a kernel uses in its module's globals. Owns nothing.
"""
from __future__ import annotations


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
