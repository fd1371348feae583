"""A chain of dependent GEMVs in one persistent launch (the batch-1 "megakernel" question; the
kernel of benchmarks/kernels/gemv_chain_bench.py, not used by the engine: measured 0.92-0.96x
the separate GEMV kernels' time on the H200, docs/benchmarks.md "A megakernel chain"):
``x_{j+1} = W_j x_j`` for the four products of each of a model's layers, every product's weight
read once, with a grid-wide count between products instead of a kernel boundary.

Why: at batch 1 a decode step is ~113 GEMVs, each a separate kernel whose ramp, tail and launch
gap cost ~2-4 us over its bytes (docs/benchmarks.md, "The batch-1 GEMV chain"). Here P programs
(all resident: the grid never exceeds what fits on the GPU at once) walk the products in order;
after its blocks of product j a program adds one to product j's count, and before product j + 1
it waits until that count reaches P. Before waiting, a program asks L2 for its first weight rows
of the next product (``cp.async.bulk.prefetch.L2``), so HBM keeps streaming weights while the
slowest programs finish: the weights do not depend on the previous product, only the input does.

Owns nothing; writes the caller's activation slots and counts. The layout (``run_chain``):
weights stacked per kind ``W_j [L, N_j, K_j]``; activation slots ``buf [4, S]``: product j of
every layer reads slot j (its first ``K_j`` values) and writes slot ``(j + 1) % 4``, so layer
``l``'s last product writes the next layer's input. Counts ``cnt [L * 4]`` int32 are zero at the
launch and are left at P (the caller zeroes them before the next launch). Activations are read
through L2 only (``.cg``): a slot is rewritten every layer, and an SM's L1 may hold its old lines.

Under the Triton interpreter programs run one after another, so only a grid of one program can
be run there (``run_chain(programs=1)``, tests/test_gemv_chain.py); the GPU runs as many as fit.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from kvfit.kernels.interpret import expose_for_interpreter, interpreting

SPIN_LIMIT = tl.constexpr(1 << 18)  # polls before a wait gives up and flags the launch


@functools.cache
def build():
    """The jitted chain kernel, built once per process on first use."""
    import triton

    if interpreting():
        @triton.jit
        def _prefetch_rows(W, row0, N, ROWS: tl.constexpr, ROW_BYTES: tl.constexpr):
            return row0
    else:
        @triton.jit
        def _prefetch_rows(W, row0, N, ROWS: tl.constexpr, ROW_BYTES: tl.constexpr):
            # rows [row0, row0 + ROWS) of W (16-bit, ROW_BYTES each) asked of L2: 128 lanes,
            # lane e prefetches chunk e % C of row e // C (C chunks a row, 16-byte multiples)
            C: tl.constexpr = max(1, 128 // ROWS)
            CHUNK: tl.constexpr = (ROW_BYTES // C + 15) // 16 * 16
            e = tl.arange(0, 128)
            row = row0 + e // C
            off = (e % C) * CHUNK
            size = tl.where((e // C < ROWS) & (row < N), tl.minimum(ROW_BYTES - off, CHUNK), 0)
            ptrs = (W + row.to(tl.int64) * (ROW_BYTES // 2) + off // 2).to(tl.int64)
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait(CNT, idx, target, ERR):
        # spin until CNT[idx] >= target (acquire); a bounded spin flags ERR instead of hanging
        c = tl.atomic_add(CNT + idx, 0, sem="acquire", scope="gpu")
        n = 0
        while (c < target) & (n < SPIN_LIMIT):
            c = tl.load(CNT + idx, volatile=True)
            n += 1
        if c < target:
            tl.atomic_add(ERR, 1)
        tl.atomic_add(CNT + idx, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _signal(CNT, idx):
        tl.debug_barrier()  # every thread's stores of this product precede the count
        tl.atomic_add(CNT + idx, 1, sem="release", scope="gpu")

    @triton.jit
    def _product(XS, W, YS, pid, n_prog, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, STAGES: tl.constexpr):
        # y[N] = W[N, K] @ x[K]: program pid computes blocks pid, pid + P, ... of BN outputs in
        # one flattened (block, k tile) loop, pipelined STAGES tiles deep
        n_blocks: tl.constexpr = N // BN
        k_tiles: tl.constexpr = K // BK
        my_blocks = tl.cdiv(n_blocks - pid, n_prog)
        ks = tl.arange(0, BK)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for it in tl.range(0, my_blocks * k_tiles, num_stages=STAGES):
            blk = pid + (it // k_tiles) * n_prog
            kt = it % k_tiles
            rows = blk * BN + tl.arange(0, BN)  # [BN]
            x = tl.load(XS + kt * BK + ks, cache_modifier=".cg").to(tl.float32)  # [BK]
            w = tl.load(W + rows.to(tl.int64)[:, None] * K + (kt * BK + ks)[None, :])  # [BN, BK]
            acc += w.to(tl.float32) * x[None, :]
            if kt == k_tiles - 1:
                tl.store(YS + rows, tl.sum(acc, axis=1).to(YS.dtype.element_ty))
                acc = tl.zeros([BN, BK], dtype=tl.float32)

    @triton.jit
    def _prefetch_mine(W, layer, pid, n_prog, N: tl.constexpr, K: tl.constexpr,
                       BN: tl.constexpr, PF: tl.constexpr):
        # this program's first PF blocks (pid, pid + P, ...) of layer's W asked of L2
        w_l = W + (tl.full([], 0, tl.int64) + layer) * (N * K)
        for i in tl.static_range(PF):
            _prefetch_rows(w_l, (pid + i * n_prog) * BN, N, BN, K * 2)

    @triton.jit
    def _step(BUF, S, W, CNT, ERR, layer, j: tl.constexpr, pid, n_prog, N: tl.constexpr,
              K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
              PF: tl.constexpr, EARLY: tl.constexpr, WN, layer_n, NN: tl.constexpr,
              KN: tl.constexpr, BNN: tl.constexpr, n_layers):
        # product j of layer: (not EARLY) ask L2 for this program's first PF blocks, wait for
        # product j - 1, compute, count; EARLY: the next product's (WN of layer_n) blocks are
        # asked for at the start instead, so they load while this product streams
        w_l = W + (tl.full([], 0, tl.int64) + layer) * (N * K)
        if PF > 0:
            if EARLY:
                if layer_n < n_layers:
                    _prefetch_mine(WN, layer_n, pid, n_prog, NN, KN, BNN, PF)
            else:
                _prefetch_mine(W, layer, pid, n_prog, N, K, BN, PF)
        idx = layer * 4 + j
        if idx > 0:
            _wait(CNT, idx - 1, n_prog, ERR)
        _product(BUF + j * S, w_l, BUF + ((j + 1) % 4) * S, pid, n_prog, N, K, BN, BK, STAGES)
        _signal(CNT, idx)

    @triton.jit
    def _chain(BUF, S, W0, W1, W2, W3, CNT, ERR, n_layers,
               N0: tl.constexpr, K0: tl.constexpr, BN0: tl.constexpr, BK0: tl.constexpr,
               N1: tl.constexpr, K1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
               N2: tl.constexpr, K2: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
               N3: tl.constexpr, K3: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr,
               STAGES: tl.constexpr, PF: tl.constexpr, EARLY: tl.constexpr = False):
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        if EARLY and PF > 0:  # the first product's blocks; every step then asks for the next's
            _prefetch_mine(W0, 0, pid, n_prog, N0, K0, BN0, PF)
        for layer in range(n_layers):
            _step(BUF, S, W0, CNT, ERR, layer, 0, pid, n_prog, N0, K0, BN0, BK0, STAGES, PF,
                  EARLY, W1, layer, N1, K1, BN1, n_layers)
            _step(BUF, S, W1, CNT, ERR, layer, 1, pid, n_prog, N1, K1, BN1, BK1, STAGES, PF,
                  EARLY, W2, layer, N2, K2, BN2, n_layers)
            _step(BUF, S, W2, CNT, ERR, layer, 2, pid, n_prog, N2, K2, BN2, BK2, STAGES, PF,
                  EARLY, W3, layer, N3, K3, BN3, n_layers)
            _step(BUF, S, W3, CNT, ERR, layer, 3, pid, n_prog, N3, K3, BN3, BK3, STAGES, PF,
                  EARLY, W0, layer + 1, N0, K0, BN0, n_layers)

    expose_for_interpreter(globals(), locals())
    return _chain


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of a compiled ``kernel`` fit on ``device`` at once (registers, shared
    memory, warps per SM): a grid that waits on itself must never exceed it."""
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs = max(1, kernel.n_regs) * 32 * warps
    regs = -(-regs // 2048) * 2048  # registers are allocated per warp in 256-register units
    shared = kernel.metadata.shared + 1024  # the driver reserves 1 KB per block
    per_sm = min(65536 // regs, props.shared_memory_per_multiprocessor // shared,
                 props.max_threads_per_multi_processor // (32 * warps), 32)
    return per_sm * props.multi_processor_count


def run_chain(buf: torch.Tensor, weights: list[torch.Tensor], tiles: list[tuple[int, int]],
              cnt: torch.Tensor, err: torch.Tensor, *, programs: int, stages: int = 3,
              prefetch_blocks: int = 0, early: bool = False, num_warps: int = 4):
    """Run every layer's four products ``buf[(j+1)%4, :N_j] = W_j[l] @ buf[j, :K_j]``.

    ``buf [4, S]`` (16-bit), ``weights``: four ``[L, N_j, K_j]`` row-major stacks of buf's
    dtype, ``tiles``: ``(BN_j, BK_j)`` dividing ``(N_j, K_j)``, ``cnt [4 L]`` int32 zero,
    ``err [1]`` int32 (gains one per timed-out wait: a grid larger than fits). ``programs``: the
    grid (at most ``resident_programs``). Returns the compiled kernel (its registers and shared
    memory)."""
    if len(weights) != 4 or len(tiles) != 4:
        raise ValueError("run_chain takes four weight stacks and four tiles")
    n_layers = weights[0].shape[0]
    consts = {}
    for j, (w, (bn, bk)) in enumerate(zip(weights, tiles)):
        _, n, k = w.shape
        if w.shape[0] != n_layers or n % bn or k % bk or max(n, k) > buf.shape[1]:
            raise ValueError(f"product {j}: weights {tuple(w.shape)} vs tile {(bn, bk)}, "
                             f"{n_layers} layers, slots of {buf.shape[1]}")
        consts.update({f"N{j}": n, f"K{j}": k, f"BN{j}": bn, f"BK{j}": bk})
    if cnt.numel() < 4 * n_layers:
        raise ValueError(f"cnt holds {cnt.numel()} counts, {4 * n_layers} needed")
    return build()[(programs,)](buf, buf.shape[1], *weights, cnt, err, n_layers, **consts,
                                STAGES=stages, PF=prefetch_blocks, EARLY=early,
                                num_warps=num_warps,
                                num_stages=stages)
