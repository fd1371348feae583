"""Per-tensor KV scales: 1.0 by default (the seed), from a JSON file, or calibrated at start.

Store divides by the scale and saturates, read multiplies by it. ``auto`` runs the model once over
a short built-in text into a throwaway pool in the compute dtype, records each layer's max |k| and
|v|, and maps it to ``CALIBRATION_FRACTION`` of the format's max (headroom for outliers beyond
the calibration text; saturation handles the rest).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

import torch

from kvfit.kvcache.dtypes import KV_FORMATS, KVFormat

log = logging.getLogger("kvfit")

CALIBRATION_FRACTION = 0.5
CALIBRATION_TEXT = (
    "The history of computing is a story of machines that learned to remember. Early computers "
    "stored numbers in mercury delay lines and on magnetic drums; later, core memory and then "
    "semiconductor chips made storage cheap. In 1969 the Apollo guidance computer flew to the Moon "
    "with 2048 words of memory. Today a phone holds billions of bytes.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n\n"
    "Question: What is 17 times 23? Answer: 17 times 23 is 391.\n"
    "Translate to French: 'The cat sleeps on the warm windowsill.' -> 'Le chat dort sur le "
    "rebord de fenetre chaud.'\n"
    "Recipe: whisk two eggs, add 200 g of flour and 300 ml of milk, rest the batter for 30 "
    "minutes, then fry thin pancakes in a hot buttered pan. Serve with lemon and sugar.\n"
) * 2


def load_scales_file(path: str, num_layers: int) -> tuple[list[float], list[float]]:
    """JSON {"k_scale": float | [per layer], "v_scale": ...} -> two lists of num_layers floats."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--kv-scales {path}: no such file (or use 'auto')")
    with open(path) as f:
        d = json.load(f)
    out = []
    for key in ("k_scale", "v_scale"):
        if key not in d:
            raise ValueError(f"--kv-scales {path}: missing {key!r} (expected "
                             f"{{\"k_scale\": [...], \"v_scale\": [...]}})")
        v = d[key]
        vals = [float(v)] * num_layers if isinstance(v, (int, float)) else [float(x) for x in v]
        if len(vals) != num_layers:
            raise ValueError(f"--kv-scales {path}: {key} has {len(vals)} values, the model has "
                             f"{num_layers} layers")
        if not all(math.isfinite(x) and x > 0 for x in vals):
            raise ValueError(f"--kv-scales {path}: {key} values must be finite and > 0")
        out.append(vals)
    return out[0], out[1]


def calibrate(runner, fmt: KVFormat, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """Max |k|, |v| per layer over ``token_ids`` -> scales mapping them to a fraction of fmax."""
    from kvfit.attention.torch_ref import TorchRefBackend

    n = len(token_ids)
    ps = runner.config.page_size
    cal_fmt = KV_FORMATS[{torch.float32: "float32", torch.bfloat16: "bfloat16",
                          torch.float16: "float16"}[runner.dtype]]
    pool = runner.pool_cls(runner.layers, -(-n // ps), ps, cal_fmt, runner.device)
    amax_k = [0.0] * len(runner.layers)
    amax_v = [0.0] * len(runner.layers)

    class Recorder(TorchRefBackend):
        def forward(self, q, k, v, layer_id):
            amax_k[layer_id] = max(amax_k[layer_id], float(k.float().abs().max()))
            amax_v[layer_id] = max(amax_v[layer_id], float(v.float().abs().max()))
            return super().forward(q, k, v, layer_id)

        def forward_mla(self, q, kv, layer_id, v_dim):  # MLA: one slab, one scale per layer
            amax_k[layer_id] = max(amax_k[layer_id], float(kv.float().abs().max()))
            amax_v[layer_id] = amax_k[layer_id]
            return super().forward_mla(q, kv, layer_id, v_dim)

    be = Recorder(pool, runner.dtype, runner.model_cls.sm_scale(runner.hf_config))
    runner.forward_tokens(token_ids, pool, be)
    target = CALIBRATION_FRACTION * fmt.max_finite
    ks = [max(a, 1e-6) / target for a in amax_k]
    vs = [max(a, 1e-6) / target for a in amax_v]
    return ks, vs


def resolve_scales(spec: Optional[str], runner, fmt: KVFormat, tokenizer=None
                   ) -> tuple[Optional[list[float]], Optional[list[float]]]:
    if spec is None:
        return None, None
    if not fmt.quantized:
        log.info("--kv-scales ignored: KV dtype %s stores values unscaled", fmt.name)
        return None, None
    if fmt.scale_mode != "tensor":
        log.info("--kv-scales ignored: %s KV keeps its own scales (%s)", fmt.name, fmt.scale_mode)
        return None, None
    if spec == "auto":
        if tokenizer is not None:
            ids = tokenizer(CALIBRATION_TEXT)["input_ids"]
        else:  # dummy weights without a tokenizer: random tokens, seeded
            g = torch.Generator().manual_seed(runner.config.seed)
            ids = torch.randint(0, runner.hf_config.vocab_size, (512,), generator=g).tolist()
        ks, vs = calibrate(runner, fmt, ids)
        log.info("KV scales (auto, %d tokens, max -> %.0f%% of %s max %g): k %s, v %s", len(ids),
                 100 * CALIBRATION_FRACTION, fmt.name, fmt.max_finite,
                 [round(s, 4) for s in ks], [round(s, 4) for s in vs])
        return ks, vs
    ks, vs = load_scales_file(spec, len(runner.layers))
    log.info("KV scales from %s", spec)
    return ks, vs
