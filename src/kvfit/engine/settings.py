"""EngineSettings: every start-up decision, resolved once from an ``EngineConfig`` before anything
is constructed (no weight loaded, no tensor allocated).

``resolve_settings(config)`` reads the model's config (HF ``AutoConfig``, also for GGUF) and
decides, in this order: device, compute dtype, KV format, the model's KV layer specs, the pool
class, the attention backend (``auto`` resolved), the page size (the backend's default when
unset), the V page layout the backend reads, and the model length as far as it is known before
the pool is sized; then runs the guard (engine/guard.py) on the whole combination. The runner,
the scheduler, ``kvfit plan`` and the seed benchmark all read the same record, so they price and
build the same pool.

``resolve_settings(config, plan_for="cuda")`` resolves for a device that need not be present
(``kvfit plan`` on a CPU machine): when the device is not here, backends are judged by what they
declare, as on a machine of that device type with every optional package (FlashInfer, Triton)
installed (``assumed_installed``); when it is here, exactly as the engine here would resolve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvfit.attention.registry import backend_class, select_backend
from kvfit.config import EngineConfig
from kvfit.engine.guard import check_combination, check_tensor_parallel
from kvfit.errors import ModelInputError
from kvfit.kvcache.dtypes import KVFormat
from kvfit.kvcache.pool import KVPool
from kvfit.kvcache.registry import resolve_pool_class
from kvfit.kvcache.sizing import SizingLimits
from kvfit.kvcache.spec import KVLayerSpec
from kvfit.models import registry as models
from kvfit.parallel.layout import local_kv_heads


@dataclass(frozen=True)
class EngineSettings:
    """What the engine will build, decided before it builds anything.

    ``config`` is the user's EngineConfig with ``page_size`` filled in; ``max_model_len`` is the
    requested length, else the model's context (the runner may lower it to the pool's capacity
    after sizing, which this record cannot know).
    """

    config: EngineConfig
    source: models.ModelSource
    hf_config: Any
    model_cls: type
    device: torch.device
    dtype: torch.dtype
    kv_format: KVFormat
    layers: tuple[KVLayerSpec, ...]
    pool_cls: type[KVPool]
    backend_name: str
    backend_chosen: str  # "requested" or "auto" (why: see select_backend)
    page_size: int
    v_layout: str
    max_model_len: int
    assumed_installed: bool = False  # planned for a device not here: every backend importable
    # tensor parallelism: ``layers`` are one rank's (its KV heads); the model's whole layers here
    full_layers: tuple[KVLayerSpec, ...] = ()

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def backend_cls(self):
        return backend_class(self.backend_name)

    def sizing_limits(self, budget_bytes: Optional[int]) -> SizingLimits:
        """The pool's bounds: ``budget_bytes`` unless ``--num-pages``/``--num-tokens`` fix it."""
        c = self.config
        return SizingLimits(budget_bytes, c.num_pages, c.num_tokens, c.max_num_seqs,
                            c.max_num_batched_tokens, self.dtype)

    def describe(self) -> str:
        """One line: backend (and how it was chosen), pool, page size, V layout, KV format."""
        how = "auto" if self.backend_chosen == "auto" else "as requested"
        tp = f", tensor parallel over {self.tp_size} ranks" if self.tp_size > 1 else ""
        return (f"attention backend {self.backend_name} ({how}), pool {self.pool_cls.name}, "
                f"pages of {self.page_size}, V pages {self.v_layout}, {self.kv_format.name} KV, "
                f"{str(self.dtype).replace('torch.', '')} compute, device {self.device.type}{tp}")


def _config_dtype(hf_config) -> Optional[torch.dtype]:
    """The checkpoint's dtype from an HF config (transformers 5 maps torch_dtype to ``dtype``)."""
    d = getattr(hf_config, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def resolve_settings(config: EngineConfig, plan_for: Optional[str] = None) -> EngineSettings:
    """Resolve ``config`` into ``EngineSettings`` and check it (raises
    ``UnsupportedCombinationError``, ``ModelNotFoundError`` or ``ValueError`` naming the fix).

    ``plan_for`` ("cpu" or "cuda"): resolve for that device type without needing it here,
    assuming every backend's packages are installed (what ``kvfit plan`` prices).
    """
    if plan_for is None:
        device = config.resolved_device
    elif plan_for in ("cpu", "cuda"):
        device = torch.device(plan_for)
    else:
        raise ValueError(f"plan_for must be 'cpu' or 'cuda', got {plan_for!r}")
    assume_installed = plan_for == "cuda" and not torch.cuda.is_available()
    source = models.resolve_model(config.model)
    if source.kind == "config" and config.load_format != "dummy" and plan_for is None:
        raise ModelInputError(f"{config.model} is a config.json without weights; add "
                              f"--load-format dummy for random weights")
    hf_config = models.load_hf_config(source)
    model_cls = models.model_class_for(hf_config)
    dtype = config.resolved_dtype(_config_dtype(hf_config), device.type)
    fmt = config.resolved_kv_dtype(dtype)
    full_layers = tuple(model_cls.kv_layer_specs(hf_config))
    pool_cls = resolve_pool_class(full_layers, fmt)
    tp = config.tensor_parallel_size
    check_tensor_parallel(tp, hf_config, model_cls, device.type, config.kv_scales,
                          torch.cuda.device_count() if plan_for is None or
                          torch.cuda.is_available() else None)
    layers = tuple(dataclasses.replace(l, num_kv_heads=local_kv_heads(l.num_kv_heads, tp))
                   for l in full_layers)  # one rank's KV heads: what its pool holds
    head_dim = layers[0].head_dim
    backend_name = select_backend(config.attention_backend, device.type, pool_cls.name, fmt.name,
                                  head_dim, assume_installed=assume_installed)
    backend = backend_class(backend_name)
    page_size = config.page_size
    if page_size is None:  # the pool's only size, else the backend's default for this KV dtype
        page_size = pool_cls.page_size_required or backend.default_page_size(fmt.name, head_dim)
        config = dataclasses.replace(config, page_size=page_size)
    check_combination(backend_name, pool_cls, fmt, page_size, device.type, layers,
                      assume_installed=assume_installed)
    ctx_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    return EngineSettings(
        config=config, source=source, hf_config=hf_config, model_cls=model_cls, device=device,
        dtype=dtype, kv_format=fmt, layers=layers, pool_cls=pool_cls, backend_name=backend_name,
        backend_chosen="auto" if config.attention_backend == "auto" else "requested",
        page_size=page_size, v_layout=backend.v_layout(fmt.name, page_size, head_dim,
                                                          pool_cls.name),
        max_model_len=config.max_model_len or ctx_len, assumed_installed=assume_installed,
        full_layers=full_layers)
