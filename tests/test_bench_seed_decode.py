"""``kvfit bench seed``'s decode timing (bench/seed_points.py ``decode_point``) on the CPU with a tiny
random Llama: it runs the engine's decode steps (every step stores its token's K/V at the
position after the last one) and returns a rate."""

from __future__ import annotations

import json

import torch

from modelhelpers import TINY


def test_decode_point_runs_the_steps(tmp_path):
    from kvfit.bench.seed_points import decode_point, fill_pool_of
    from kvfit.config import make_config
    from kvfit.engine.runner import ModelRunner

    cfg = dict(TINY["llama"], architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(make_config(model=str(tmp_path / "config.json"), load_format="dummy",
                                     device="cpu", num_tokens=1024, max_model_len=256,
                                     max_num_seqs=4, max_num_batched_tokens=256))
    fill_pool_of(runner)
    pool = runner.pool
    ps = pool.page_size
    ctx, steps = 20, 5
    per = -(-(ctx + steps + 4) // ps)  # decode_point's pages per request: request 1 from `per`
    before = [t.clone() for t in pool.k_caches]
    rate = decode_point(runner, 2, ctx, steps)
    assert rate > 0
    for req in (0, 1):
        for pos in range(ctx + 3 + steps):  # 3 warm-up steps, then the timed ones
            page, slot = req * per + pos // ps, pos % ps
            changed = not torch.equal(pool.k_caches[0][page, :, slot] if pool.k_caches[0].dim()
                                      == 4 else pool.k_caches[0][page, slot],
                                      before[0][page, :, slot] if before[0].dim() == 4
                                      else before[0][page, slot])
            assert changed == (pos >= ctx), (req, pos)
