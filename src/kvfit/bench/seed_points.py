"""The timed points of ``kvfit bench seed``: decode steps at a batch and context over pages
filled with random KV, and one long prefill, each run as the engine runs a step
(``ModelRunner.run_plan`` with a ``StepPlan``), so the same code times one GPU and a
tensor-parallel group (rank 0 hands every step to the workers; every rank's pool is filled).

Decode feeds each step's greedy tokens back as the next step's input ids on the device
(``StepPlan.carried``), as the engine's overlap scheduling does: no device->host sync per step
(under tensor parallelism the carried ids are broadcast to the workers, as in the engine).
"""

from __future__ import annotations

import time

import numpy as np


def _sync(runner) -> None:
    import torch

    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def fill_pool_of(runner, seed: int = 0) -> None:
    """Random KV in every page of ``runner``'s pool (never time on uninitialised memory: NaN
    patterns, zeros); a hybrid pool's sliding null page stays zero, as the pool keeps it. Run
    it on every rank with ``runner.collective_call(fill_pool_of)``."""
    import torch

    pool = runner.pool
    g = torch.Generator(device=pool.device).manual_seed(seed)
    if pool.residual_slots is not None:  # int4: random codes, positive scales, residual pages
        for t in (*pool.k_caches, *pool.v_caches):
            t.random_(0, 256, generator=g)
        for t in (*pool.k_scale_caches, *pool.v_scale_caches):
            t.copy_(torch.rand(t.shape, generator=g, device=pool.device) * 0.1 + 0.01)
        for t in (*pool.k_zero_caches, *pool.v_zero_caches, *pool.k_residual, *pool.v_residual):
            t.copy_(torch.randn(t.shape, generator=g, device=pool.device))
        return
    # MLA pools hold one latent slab per token (kv_caches), the others K and V
    caches = getattr(pool, "kv_caches", None) or (*pool.k_caches, *pool.v_caches)
    for t in caches:
        flat = t.view(-1)
        step = 1 << 28
        for i in range(0, flat.numel(), step):
            chunk = torch.randn(min(step, flat.numel() - i), generator=g, device=pool.device)
            flat[i:i + step] = chunk.to(t.dtype)
    if pool.sliding_pages is not None:
        for spec, kc, vc in zip(pool.layers, pool.k_caches, pool.v_caches):
            if spec.kind == "sliding":
                kc[pool.null_page] = 0
                vc[pool.null_page] = 0


def sliding_tables(pool, rids: list[str], ctx: int, end: int,
                   max_num_batched_tokens: int) -> list[list[int]] | None:
    """A hybrid pool's sliding page lists for requests whose first ``ctx`` tokens are cached
    and that will decode up to position ``end``: reserved in prefill chunks as the scheduler
    does (pages behind the window released as it goes, chunks sharing the step's token budget),
    so only the window's pages are held. None for other pools."""
    sliding = pool.sliding_pages
    if sliding is None:
        return None
    ps = pool.page_size
    chunk = max(ps, max_num_batched_tokens // len(rids) // ps * ps)
    for rid in rids:
        for s in range(0, ctx, chunk):
            sliding.reserve(rid, s, min(s + chunk, ctx))
        sliding.reserve(rid, ctx, end)
    return [sliding.table(rid) for rid in rids]


def free_sliding(pool, rids: list[str]) -> None:
    if pool.sliding_pages is not None:
        for rid in rids:
            pool.sliding_pages.free(rid)


def hold_residual_slots(pool, rids: list[str]) -> None:
    """The int4 pool's residual slots for the bench's requests (as the scheduler assigns)."""
    if pool.residual_slots is not None:
        for rid in rids:
            pool.residual_slots.assign(rid)


def free_residual_slots(pool, rids: list[str]) -> None:
    if pool.residual_slots is not None:
        for rid in rids:
            pool.residual_slots.release(rid)


def decode_point(runner, batch: int, ctx: int, steps: int) -> float:
    """tok/s of ``steps`` decode steps of ``batch`` requests at context ``ctx`` (pages filled;
    3 untimed steps first)."""
    import torch

    from kvfit.engine.runner import StepPlan

    ps = runner.pool.page_size
    per = -(-(ctx + steps + 4) // ps)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    rids = [f"bench{i}" for i in range(batch)]
    sliding_tables(runner.pool, rids, ctx, ctx + steps + 4, runner.config.max_num_batched_tokens)
    hold_residual_slots(runner.pool, rids)
    rng = np.random.default_rng(0)
    first_ids = rng.integers(0, runner.hf_config.vocab_size, batch, dtype=np.int64)
    lens = [ctx] * batch
    rows = list(range(batch))
    prev = None

    def step():
        nonlocal prev
        for i in range(batch):
            lens[i] += 1
        plan = StepPlan(first_ids, np.asarray([n - 1 for n in lens], dtype=np.int64),
                        [1] * batch, list(lens), tables, rids,
                        [] if prev is None else [(i, i) for i in rows], rows, [])
        prev = runner.run_plan(plan, prev).sample_logits.argmax(-1)  # [batch] on the device

    try:
        with torch.inference_mode():
            for _ in range(3):
                step()
            _sync(runner)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(runner)
    finally:
        free_sliding(runner.pool, rids)
        free_residual_slots(runner.pool, rids)
    return batch * steps / (time.perf_counter() - t0)


def prefill_point(runner, n: int, repeats: int = 8) -> float:
    """tok/s of one ``n``-token prompt prefilled from scratch: best of ``repeats - 1`` after a
    warm-up (at a few thousand tokens the step is partly host-bound, Python launch overhead ~
    GPU time, so single steps vary with host jitter)."""
    from kvfit.engine.runner import StepPlan

    ps = runner.pool.page_size
    pages = list(range(-(-n // ps)))
    rid = "bench-prefill"
    if runner.pool.sliding_pages is not None:  # the sliding layers' pages of the prompt
        runner.pool.sliding_pages.reserve(rid, 0, n)
    hold_residual_slots(runner.pool, [rid])
    rng = np.random.default_rng(1)
    plan = StepPlan(rng.integers(0, runner.hf_config.vocab_size, n, dtype=np.int64),
                    np.arange(n, dtype=np.int64), [n], [n], [pages], [rid], [], [n - 1], [])
    times = []
    try:
        for _ in range(repeats):
            _sync(runner)
            t0 = time.perf_counter()
            runner.run_plan(plan)
            _sync(runner)
            times.append(time.perf_counter() - t0)
    finally:
        free_sliding(runner.pool, [rid])
        free_residual_slots(runner.pool, [rid])
    return n / min(times[1:])
