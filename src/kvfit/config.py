"""EngineConfig: the one frozen source of every engine setting, and the CLI flags derived from it.

Each field's ``metadata`` carries its help text and flag aliases; ``add_engine_args`` turns the
fields into argparse flags (``Literal`` types become ``choices``), so a default lives in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Optional

import torch

from kvfit.kvcache.dtypes import KV_DTYPE_CHOICES, KVFormat, kv_format, resolve_kv_dtype

ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
KVDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
                  "int4"]
Backend = Literal["auto", "torch", "fi", "triton"]
LoadFormat = Literal["auto", "dummy"]
Device = Literal["auto", "cpu", "cuda"]
AsyncMode = Literal["auto", "on", "off"]
KCentering = Literal["auto", "on", "off"]
DecodeGemv = Literal["auto", "on", "off"]

assert set(typing.get_args(KVDtype)) == set(KV_DTYPE_CHOICES)  # one table, checked at import

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the largest prefill CUDA graph bucket accepted (the default token budget of a step)
MAX_PREFILL_GRAPH_TOKENS = 8192


def _f(default, help: str, aliases: tuple[str, ...] = (), **kw):
    return field(default=default, metadata={"help": help, "aliases": aliases, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting. Validated in ``__post_init__``; derived values are cached properties."""

    model: str = _f("smollm2-135m", "model: HF directory, .gguf file, config.json (with "
                    "--load-format dummy) or a known short name (smollm2-135m, qwen2.5-coder-0.5b, "
                    "gemma3-270m)")
    tokenizer: Optional[str] = _f(None, "tokenizer directory (default: the model's)")
    dtype: ModelDtype = _f("auto", "model/compute dtype; auto = the config's dtype on CUDA, "
                           "float32 on CPU")
    kv_dtype: KVDtype = _f("auto", "KV-cache element type; auto = the model dtype, fp8 = fp8_e4m3, "
                           "int4 = KIVI-style 4-bit (pages of 32)",
                           aliases=("--kv-cache-dtype",))
    kv_scales: Optional[str] = _f(None, "per-tensor KV scales: 'auto' (calibrate at start) or a "
                                  "JSON file {\"k_scale\": [...], \"v_scale\": [...]}; default 1.0")
    kv_k_centering: KCentering = _f("auto", "subtract a calibrated per-(layer, KV head, channel) "
                                    "mean from K before storing (exact for softmax; on backends "
                                    "that apply it): auto = on for int8 (its format relies on "
                                    "it), off for fp8 (not measured never-worse: greedy "
                                    "agreement with bf16 KV fell on SmolLM2); on/off force it")
    kv_calibration: Optional[str] = _f(None, "JSON file of the K means (written by python -m "
                                       "kvfit.engine.write_kv_calibration); default: calibrate "
                                       "at start on shipped text")
    device: Device = _f("auto", "cuda when available, else cpu")
    attention_backend: Backend = _f("auto", "attention backend; auto on CUDA = triton for fp8 KV "
                                    "with heads of >= 128, 16-bit KV with heads of 128 and "
                                    "MLA (DeepSeek) pools, else fi when FlashInfer imports, "
                                    "else triton; torch on CPU")
    page_size: Optional[int] = _f(None, "tokens per KV page; default 32 for fp8 KV on the "
                                  "triton backend (fastest decode), else 16",
                                  aliases=("--block-size",))
    memory_ratio: float = _f(0.9, "fraction of free GPU memory the engine may use (weights, "
                             "activations, KV)", aliases=("--gpu-memory-utilization",))
    cpu_kv_space_gib: float = _f(4.0, "KV budget on CPU in GiB (capped by free RAM)")
    num_pages: Optional[int] = _f(None, "KV pages to allocate (overrides the memory budget)")
    num_tokens: Optional[int] = _f(None, "KV tokens to allocate (overrides the memory budget)")
    max_model_len: Optional[int] = _f(None, "longest prompt + output (default: the model's context)")
    max_num_seqs: int = _f(256, "most requests running at once")
    max_num_batched_tokens: int = _f(8192, "token budget of one step (chunked prefill size; "
                                     "8192 chosen from H200 measurements, docs/benchmarks.md)")
    enforce_eager: bool = _f(False, "disable CUDA graphs", aliases=("--no-cuda-graph",))
    cuda_graph_max_bs: Optional[int] = _f(None, "largest decode batch captured in a CUDA graph "
                                          "(default: max_num_seqs, so every decode batch "
                                          "replays a graph)")
    cuda_graph_max_prefill_tokens: int = _f(
        2048, "largest prefill/extend step (tokens, up to 8 requests) run from a CUDA graph "
        "(2048: a 1,024-token prompt's TTFT 18.6 -> 7.1 ms on the H200, docs/benchmarks.md); "
        "0 = such steps run eagerly; at most %d (steps above 512 tokens attend without "
        "splitting their keys, as eager ones do)" % MAX_PREFILL_GRAPH_TOKENS)
    async_scheduling: AsyncMode = _f("auto", "overlap the host's scheduling and output "
                                     "processing of one step with the GPU's next step; auto = "
                                     "on with CUDA, off on CPU")
    decode_gemv: DecodeGemv = _f("auto", "run one-token decode steps through the fused "
                                 "CUDA-core GEMV (kernels/gemv.py: a layer's products and norms "
                                 "in 4 launches; batch-1 decode +12-16%% on the H200, "
                                 "docs/benchmarks.md): auto = on when max_num_seqs is 1 (every decode step is "
                                 "one token, so nothing changes with batching); on = every "
                                 "one-token step, at the price of batch invariance (a seeded "
                                 "request may then sample other tokens alone than batched, as "
                                 "in vLLM and SGLang by default); off = cuBLAS")
    enable_prefix_caching: bool = _f(True, "reuse the KV pages of prompt prefixes that earlier "
                                     "requests computed (off: --no-enable-prefix-caching)")
    tensor_parallel_size: int = _f(1, "GPUs (ranks) the model is sharded over with tensor "
                                   "parallelism: one process per rank, started by kvfit; NCCL "
                                   "on CUDA, gloo on CPU", aliases=("--tp-size", "--tp"))
    load_format: LoadFormat = _f("auto", "dummy = random weights from config.json alone")
    seed: int = _f(0, "seed for dummy weights and unseeded sampling")

    def __post_init__(self):
        kv_format(self.kv_dtype) if self.kv_dtype != "auto" else None
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_bs",
                     "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.cuda_graph_max_prefill_tokens <= MAX_PREFILL_GRAPH_TOKENS:
            raise ValueError(f"cuda_graph_max_prefill_tokens must be in "
                             f"0..{MAX_PREFILL_GRAPH_TOKENS} (0 = no prefill graphs), got "
                             f"{self.cuda_graph_max_prefill_tokens}")
        if self.kv_k_centering not in typing.get_args(KCentering):
            raise ValueError(f"kv_k_centering must be one of {typing.get_args(KCentering)}, "
                             f"got {self.kv_k_centering!r}")
        if self.decode_gemv not in typing.get_args(DecodeGemv):
            raise ValueError(f"decode_gemv must be one of {typing.get_args(DecodeGemv)}, "
                             f"got {self.decode_gemv!r}")
        if self.async_scheduling not in typing.get_args(AsyncMode):
            raise ValueError(f"async_scheduling must be one of {typing.get_args(AsyncMode)}, "
                             f"got {self.async_scheduling!r}")
        if not 0.0 < self.memory_ratio <= 1.0:
            raise ValueError(f"memory_ratio must be in (0, 1], got {self.memory_ratio}")
        for name in ("num_pages", "num_tokens", "max_model_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 when given, got {v}")
        if self.num_pages is not None and self.num_tokens is not None:
            raise ValueError("give num_pages or num_tokens, not both")
        if self.cpu_kv_space_gib <= 0:
            raise ValueError(f"cpu_kv_space_gib must be > 0, got {self.cpu_kv_space_gib}")

    @cached_property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use --device cpu")
        return torch.device(self.device)

    @cached_property
    def resolved_async_scheduling(self) -> bool:
        """Overlap scheduling on or off (auto: on with CUDA, where there is a GPU to overlap)."""
        if self.async_scheduling == "auto":
            return self.resolved_device.type == "cuda"
        return self.async_scheduling == "on"

    @property
    def resolved_decode_gemv(self) -> bool:
        """One-token decode steps through the GEMV (auto: only when no step batches requests)."""
        if self.decode_gemv == "auto":
            return self.max_num_seqs == 1
        return self.decode_gemv == "on"

    @property
    def resolved_cuda_graph_max_bs(self) -> int:
        """Largest captured decode batch: cuda_graph_max_bs, else max_num_seqs (never above)."""
        if self.cuda_graph_max_bs is None:
            return self.max_num_seqs
        return min(self.cuda_graph_max_bs, self.max_num_seqs)

    def resolved_dtype(self, config_dtype: Optional[torch.dtype],
                       device_type: Optional[str] = None) -> torch.dtype:
        """The compute dtype: explicit, else the config's on CUDA (bf16 if none), float32 on CPU.
        ``device_type`` defaults to the resolved device's (given when planning for another)."""
        if self.dtype != "auto":
            return _TORCH_DTYPES[self.dtype]
        if (device_type or self.resolved_device.type) == "cuda":
            return config_dtype if config_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        return torch.float32

    def resolved_kv_dtype(self, model_dtype: torch.dtype) -> KVFormat:
        """The pool's element format: ``auto`` = the model dtype (default behaviour unchanged)."""
        return resolve_kv_dtype(self.kv_dtype, model_dtype)


_KWARG_NAMES = {f.name for f in dataclasses.fields(EngineConfig)}


def make_config(**kwargs) -> EngineConfig:
    """EngineConfig from keyword arguments; a misspelt name is a TypeError naming close matches."""
    unknown = set(kwargs) - _KWARG_NAMES - {"kv_cache_dtype", "tp_size"}
    if unknown:
        import difflib

        hints = {u: difflib.get_close_matches(u, _KWARG_NAMES, n=1) for u in unknown}
        msg = ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for u, h in hints.items())
        raise TypeError(f"unknown engine argument(s): {msg}")
    if "kv_cache_dtype" in kwargs:  # vLLM spelling
        kwargs["kv_dtype"] = kwargs.pop("kv_cache_dtype")
    if "tp_size" in kwargs:  # SGLang spelling
        kwargs["tensor_parallel_size"] = kwargs.pop("tp_size")
    return EngineConfig(**kwargs)


def _unwrap_optional(tp):
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                    many: tuple[str, ...] = (), defaults: Optional[dict] = None) -> None:
    """Add one flag per EngineConfig field (``--kv-dtype`` for ``kv_dtype``, plus aliases),
    except those in ``skip``; fields in ``many`` take one or more values (a list); ``defaults``
    replaces a field's default for this command (``kvfit plan`` plans for cuda)."""
    defaults = defaults or {}
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        tp = _unwrap_optional(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = defaults.get(f.name, f.default)
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        kw: dict = {"dest": f.name, "default": default, "help": f"{f.metadata['help']} "
                    f"(default: {shown})"}
        if tp is bool and f.default is True:  # --x / --no-x (vLLM's --no-enable-prefix-caching)
            kw["action"] = argparse.BooleanOptionalAction
        elif tp is bool:
            kw["action"] = "store_true"
        elif typing.get_origin(tp) is Literal:
            kw["choices"] = list(typing.get_args(tp))
        else:
            kw["type"] = tp
        if f.name in many:
            kw["nargs"] = "+"
        group.add_argument(*flags, **kw)


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    vals = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if hasattr(args, f.name)}
    vals.update(overrides)
    return EngineConfig(**vals)
