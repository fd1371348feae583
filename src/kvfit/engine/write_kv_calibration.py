"""``python -m kvfit.engine.write_kv_calibration --model M --out F.json``: calibrate the K means
of K centering (engine/kv_calibration.py) on a text of your choice and write them for
``--kv-calibration F.json``."""

from __future__ import annotations

import argparse
import math
import time
from typing import Optional

from kvfit.engine.kv_calibration import calibrate_k_mean, calibration_ids, save_calibration


def main(argv: Optional[list[str]] = None) -> int:
    """Write a K-mean file: ``python -m kvfit.engine.write_kv_calibration --model M --out F.json
    [--text-file T] [--max-tokens N]``."""
    p = argparse.ArgumentParser(prog="python -m kvfit.engine.write_kv_calibration",
                                description=main.__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--text-file", default=None, help="calibrate on this text (default: shipped)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    from kvfit.config import EngineConfig
    from kvfit.engine.runner import ModelRunner
    from kvfit.models.registry import load_tokenizer, resolve_model

    text = open(args.text_file).read() if args.text_file else None
    tok = load_tokenizer(resolve_model(args.model), None)
    ids = calibration_ids(tok, 0, 0, text)[: args.max_tokens]
    runner = ModelRunner(EngineConfig(model=args.model, device=args.device,
                                      num_tokens=len(ids) + 64, max_model_len=len(ids) + 64,
                                      max_num_batched_tokens=max(len(ids), 16)), tok)
    t0 = time.monotonic()
    k_mean = calibrate_k_mean(runner, ids)
    save_calibration(args.out, k_mean, {"model": args.model, "tokens": len(ids),
                                        "text": args.text_file or "shipped"})
    peak = max(float(m.abs().max()) for m in k_mean if m is not None)
    print(f"wrote {args.out}: K means of {len(k_mean)} layers over {len(ids)} tokens in "
          f"{time.monotonic() - t0:.1f} s (largest |mean| {peak:.1f})")
    return 0 if math.isfinite(peak) else 1


if __name__ == "__main__":
    raise SystemExit(main())
