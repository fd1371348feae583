"""The K means of K centering (kvcache/kv_transform.py): calibrated at start or loaded from a file,
and the pool's ``KVTransform`` built from them.

Calibration runs the model once over shipped text (``CALIBRATION_TEXT`` of engine/kv_scales.py:
prose, code, a question and a recipe) into a throwaway pool in the compute dtype (no
quantization), and averages the post-RoPE keys of every layer per KV head and channel (float64
sums). Logged: the text, the token count, the seconds. ``--kv-calibration PATH`` loads a JSON
file instead, written by ``python -m kvfit.engine.write_kv_calibration`` (docs/benchmarks.md measures
how much the result depends on the text).

Which formats get what (``resolve_kv_transform``): int8 is rotated (its ``KVFormat.rotate``) and
centered; fp8 is centered only (rotation measured unsafe for fp8); 16-bit formats and int4 (whose
per-channel zero point absorbs a K mean) get nothing.
Centering needs a backend that declares ``"k_mean"`` in ``kv_transforms``; ``--kv-k-centering off``
turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional, Sequence

import torch

from kvfit.kvcache.dtypes import KV_FORMATS
from kvfit.kvcache.kv_transform import KVTransform

log = logging.getLogger("kvfit")

FILE_VERSION = 1


def calibration_ids(tokenizer, vocab_size: int, seed: int, text: Optional[str] = None
                    ) -> list[int]:
    """Token ids of ``text`` (default: the shipped ``CALIBRATION_TEXT``); without a tokenizer
    (dummy weights), 512 seeded random tokens."""
    from kvfit.engine.kv_scales import CALIBRATION_TEXT

    if tokenizer is not None:
        return tokenizer(CALIBRATION_TEXT if text is None else text)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (512,), generator=g).tolist()


def calibrate_k_mean(runner, token_ids: Sequence[int]) -> list[Optional[torch.Tensor]]:
    """Mean post-RoPE key per layer, KV head and channel over ``token_ids``: one float32
    ``[num_kv_heads, head_dim]`` per layer (None for layers that store no per-head K, e.g. MLA).
    Uses a throwaway pool in the compute dtype; mutates nothing of the runner's."""
    from kvfit.attention.torch_ref import TorchRefBackend

    n = len(token_ids)
    if n == 0:
        raise ValueError("K-mean calibration needs at least one token")
    ps = runner.config.page_size
    cal_fmt = KV_FORMATS[{torch.float32: "float32", torch.bfloat16: "bfloat16",
                          torch.float16: "float16"}[runner.dtype]]
    pool = runner.pool_cls(runner.layers, -(-n // ps), ps, cal_fmt, runner.device)
    sums: list[Optional[torch.Tensor]] = [None] * len(runner.layers)

    class Recorder(TorchRefBackend):
        def forward(self, q, k, v, layer_id):
            s = k.double().sum(0)  # [Hkv, D]
            sums[layer_id] = s if sums[layer_id] is None else sums[layer_id] + s
            return super().forward(q, k, v, layer_id)

    be = Recorder(pool, runner.dtype, runner.model_cls.sm_scale(runner.hf_config),
                  runner.model_cls.logit_softcap_of(runner.hf_config))
    runner.forward_tokens(list(token_ids), pool, be)
    return [None if s is None else (s / n).float().cpu() for s in sums]


def save_calibration(path: str, k_mean: Sequence[Optional[torch.Tensor]], meta: dict) -> None:
    """Write the means (and ``meta``: model, text, tokens) as JSON."""
    with open(path, "w") as f:
        json.dump({"version": FILE_VERSION, **meta,
                   "k_mean": [None if m is None else m.tolist() for m in k_mean]}, f)


def load_calibration(path: str, layers) -> list[Optional[torch.Tensor]]:
    """The means of a ``save_calibration`` file, checked against the model's layer specs
    (ValueError naming the mismatch and the fix)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--kv-calibration {path}: no such file (write one with python -m "
                                f"kvfit.engine.write_kv_calibration --model M --out {path})")
    with open(path) as f:
        d = json.load(f)
    means = d.get("k_mean") if isinstance(d, dict) else None
    if not isinstance(means, list) or len(means) != len(layers):
        raise ValueError(f"--kv-calibration {path}: expected 'k_mean' with one entry per layer "
                         f"({len(layers)}), got {len(means) if isinstance(means, list) else means!r}"
                         "; was it written for another model?")
    out: list[Optional[torch.Tensor]] = []
    for i, (m, spec) in enumerate(zip(means, layers)):
        if m is None:
            out.append(None)
            continue
        t = torch.tensor(m, dtype=torch.float32)
        if tuple(t.shape) != (spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"--kv-calibration {path}: layer {i} mean has shape "
                             f"{tuple(t.shape)}, the model needs ({spec.num_kv_heads}, "
                             f"{spec.head_dim}); was it written for another model?")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"--kv-calibration {path}: layer {i} mean is not finite")
        out.append(t)
    return out


def _rank0_ids(ids: list[int]) -> list[int]:
    """Rank 0's calibration ids on every rank (only rank 0 has the tokenizer): under tensor
    parallelism every rank runs the calibration forward together (its collectives pair up),
    each recording the means of its own KV heads."""
    from kvfit.parallel.state import tp_group

    g = tp_group()
    if g.size == 1:
        return ids
    import torch.distributed as dist

    box = [ids]
    dist.broadcast_object_list(box, src=0, group=g.cpu_group)
    return box[0]


def _rank_share(k_mean: list[Optional[torch.Tensor]], runner) -> list[Optional[torch.Tensor]]:
    """The rank's KV heads of whole-model means ``[num_kv_heads, head_dim]`` per layer (the
    heads its pool stores, parallel/layout.py); the means unchanged with one rank."""
    from kvfit.parallel.layout import shard_heads
    from kvfit.parallel.state import tp_group

    g = tp_group()
    if g.size == 1:
        return k_mean
    out: list[Optional[torch.Tensor]] = []
    for m in k_mean:
        if m is None:
            out.append(None)
            continue
        sh = shard_heads(runner.hf_config.num_attention_heads, m.shape[0], g.rank, g.size)
        out.append(m[sh.kv_start:sh.kv_start + sh.kv_count].contiguous())
    return out


def resolve_kv_transform(runner, tokenizer=None) -> Optional[KVTransform]:
    """The pool's ``KVTransform`` for the runner's KV format, backend and flags (None when none
    applies); calibrates (or loads) the K means when centering is on. Logs what it did."""
    fmt, config, backend = runner.kv_format, runner.config, runner.settings.backend_cls
    rotate = fmt.rotate
    # int4 (kivi) is not centered: its per-channel zero point over each page absorbs a K mean
    mode = config.kv_k_centering  # auto: int8 only (fp8 centering is opt-in, see config.py)
    wanted = mode == "on" or (mode == "auto" and fmt.scale_mode == "token_head")
    center = (fmt.quantized and fmt.scale_mode != "kivi" and wanted
              and "mla" not in {l.kind for l in runner.layers})
    if center and "k_mean" not in backend.kv_transforms:
        log.info("K centering off: the %s backend does not apply it", backend.name)
        center = False
    if not center and config.kv_calibration is not None:
        log.info("--kv-calibration ignored: no K centering for %s KV here", fmt.name)
    if not center and not rotate:
        return None
    k_mean: list[Optional[torch.Tensor]] = [None] * len(runner.layers)
    source = ""
    if center:
        t0 = time.monotonic()
        if config.kv_calibration is not None:
            k_mean = _rank_share(load_calibration(config.kv_calibration,
                                                  runner.settings.full_layers), runner)
            source = f"from {config.kv_calibration}"
        else:
            ids = calibration_ids(tokenizer, runner.hf_config.vocab_size, config.seed)
            ids = _rank0_ids(ids[: runner.max_model_len])  # RoPE tables end at max_model_len
            k_mean = calibrate_k_mean(runner, ids)
            what = "shipped prose/code text" if tokenizer is not None else "random tokens"
            source = f"calibrated on {len(ids)} tokens of {what}"
        peak = max((float(m.abs().max()) for m in k_mean if m is not None), default=0.0)
        log.info("K means %s in %.1f s (largest |mean| %.1f)", source, time.monotonic() - t0,
                 peak)
    tf = KVTransform(k_mean, rotate, runner.device, source)
    log.info("KV transform for %s: %s", fmt.name, tf.describe())
    return tf
