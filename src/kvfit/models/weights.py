"""Weight loading into kvfit modules: HF safetensors shards, GGUF files (dequantized with ``gguf``),
and dummy (random) weights.

Every source yields ``(hf_name, tensor)`` pairs in the HF checkpoint naming; ``WeightSink`` writes
each one into the model's parameter, into its slice when the parameter is a fused one
(``qkv_proj`` = [q; k; v] rows, ``gate_up_proj`` = [gate; up] rows). Missing parameters are an
error naming them, never silently left random.

Tensor parallel (``kvfit/parallel``): the sink writes the rank's part of each checkpoint tensor,
as the module holding it says (``tp_slice``: its heads' rows of q/k/v or of MLA's q/kv_b, its
rows of gate/up of the MLP and of every expert, its columns of o_proj/down_proj), its
vocabulary rows of the embedding and the LM head; the rest whole. ``iter_safetensors(lazy=True)`` yields
``LazyTensor``s that read only the slice asked for from the file, so no rank materialises the
whole model; GGUF tensors are dequantized one at a time and cut.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterator

import numpy as np
import torch
from torch import nn

# HF shard name -> (fused param name, shard index); order of shards = row order in the fused param
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LazyTensor:
    """A checkpoint tensor not read yet: ``shape``, ``read()`` (all of it) and ``narrow(dim,
    start, length)`` (only that slice read from the file)."""

    def __init__(self, sf_slice):
        self._slice = sf_slice
        self.shape = tuple(sf_slice.get_shape())

    def read(self) -> torch.Tensor:
        return self._slice[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def _materialise(t) -> torch.Tensor:
    return t.read() if isinstance(t, LazyTensor) else t


_VOCAB_SHARDED = ("model.embed_tokens.weight", "lm_head.weight")


class WeightSink:
    """Copies named tensors into a model (mutates its parameters); tracks what was filled.
    Under tensor parallelism (``tp_group().size > 1``) copies the rank's slice of each."""

    def __init__(self, model: nn.Module):
        from kvfit.parallel.state import tp_group

        self.model = model
        self.params = dict(model.named_parameters())
        self.filled: set[str] = set()
        self.tied = getattr(model, "tie_word_embeddings", False)
        self.tp = tp_group()

    def _rank_part(self, name: str, tensor):
        """The rank's slice of checkpoint tensor ``name`` (the whole tensor with one rank or for
        replicated weights), read from the file only now when lazy. The module holding the
        projection says which slice (its ``tp_slice(leaf, kind)``: attention heads, MLP and
        expert rows, MLA heads), so a new sharded layer brings its own rule."""
        if self.tp.size == 1:
            return _materialise(tensor)
        m = re.match(r"(.*)\.(\w+_proj)\.(weight|bias)$", name)
        if m:
            try:
                mod = self.model.get_submodule(m.group(1))
            except AttributeError:
                mod = None  # not in the model: put() names it
            rule = getattr(mod, "tp_slice", None)
            cut = rule(m.group(2), m.group(3)) if rule is not None else None
            if cut is not None:
                return tensor.narrow(*cut)
        return _materialise(tensor)

    def _shard_rows(self, fused_param: str, module_path: str) -> list[int]:
        attn = self.model.get_submodule(module_path)
        if fused_param == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        half = self.params[f"{module_path}.gate_up_proj.weight"].shape[0] // 2
        return [half, half]

    def put(self, name: str, tensor) -> None:
        """Write checkpoint tensor ``name`` (a torch tensor or a ``LazyTensor``) into the model."""
        if self.tied and name == "lm_head.weight":
            return  # tied: the embedding is the head
        if name in _VOCAB_SHARDED and name in self.params and self.tp.size > 1:
            self._put_vocab_rows(name, tensor)
            return
        tensor = self._rank_part(name, tensor)
        m = re.match(r"(.*)\.(\w+_proj)\.(weight|bias)$", name)
        if m and m.group(2) in FUSED and m.group(2) not in ("qkv_proj", "gate_up_proj"):
            path, shard, kind = m.groups()
            fused, idx = FUSED[shard]
            target = f"{path}.{fused}.{kind}"
            if target not in self.params and name in self.params:
                self._copy(name, self.params[name].data, tensor)  # unfused here (e.g. MLA q_proj)
                self.filled.add(name)
                return
            if target not in self.params:
                raise KeyError(f"checkpoint tensor {name} has no place in the model ({target})")
            rows = self._shard_rows(fused, path)
            start = sum(rows[:idx])
            dst = self.params[target].data[start:start + rows[idx]]
            self._copy(name, dst, tensor)
            self.filled.add(f"{target}#{idx}")
            return
        if name not in self.params:
            if name.endswith("rotary_emb.inv_freq"):
                return
            raise KeyError(f"checkpoint tensor {name} has no place in the model")
        self._copy(name, self.params[name].data, tensor)
        self.filled.add(name)

    def _put_vocab_rows(self, name: str, tensor) -> None:
        """The rank's vocabulary rows into the first rows of its (padded) table; padding zero."""
        from kvfit.parallel.layout import shard_vocab

        dst = self.params[name].data
        vocab = tensor.shape[0]
        shard = shard_vocab(vocab, self.tp.rank, self.tp.size)
        if shard.padded != dst.shape[0]:
            raise ValueError(f"shape mismatch for {name}: checkpoint vocabulary {vocab} gives "
                             f"{shard.padded} rows per rank, model has {dst.shape[0]}")
        dst.zero_()
        if shard.count:
            self._copy(name, dst[:shard.count], tensor.narrow(0, shard.start, shard.count))
        self.filled.add(name)

    @staticmethod
    def _copy(name, dst, src):
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(src.shape)}, "
                             f"model {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))

    def check_complete(self) -> None:
        missing = []
        for pname in self.params:
            base = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if base in ("qkv_proj", "gate_up_proj"):
                n = 3 if base == "qkv_proj" else 2
                if not all(f"{pname}#{i}" in self.filled for i in range(n)):
                    missing.append(pname)
            elif pname not in self.filled:
                missing.append(pname)
        if missing:
            more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}{more}")


def iter_safetensors(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's shards; ``lazy``: as ``LazyTensor``s (read on use, valid
    until the next item)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, (LazyTensor(sf.get_slice(name)) if lazy else sf.get_tensor(name))


# GGUF tensor names -> HF names (llama.cpp conventions); families may extend this table.
GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
               "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
              "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}


# per-architecture overrides of GGUF_BLOCK (llama.cpp names whose HF meaning differs)
GGUF_ARCH_BLOCK = {
    # Gemma's ffn_norm is the pre-feedforward norm; post_attention_norm/post_ffw_norm as generic
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
# architectures whose GGUF norm weights hold (1 + w): subtract 1 to get HF's w (as transformers'
# Gemma2TensorProcessor does), so the (1 + w) RMSNorm (offset=1) sees HF's values
GGUF_NORM_PLUS_ONE = frozenset({"gemma", "gemma2", "gemma3"})


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2)
            .reshape(rows, *rest))


def iter_gguf(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor of a GGUF file and yield it under its HF name."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    table = {**GGUF_BLOCK, **GGUF_ARCH_BLOCK.get(arch, {})}
    for t in reader.tensors:
        name = t.name
        if name in GGUF_GLOBAL:
            hf = GGUF_GLOBAL[name]
        else:
            m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
            if not m or m.group(2) not in table:
                if name.startswith("rope_freqs"):
                    continue
                raise KeyError(f"GGUF tensor {name} is not known to kvfit's {arch} loader")
            hf = f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
        arr = dequantize(t.data, t.tensor_type)
        # GGUF stores dims reversed; dequantize returns torch's [out, in] layout for 2-D weights
        arr = np.array(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
            n = hf_config.num_attention_heads if ".attn_q." in name else hf_config.num_key_value_heads
            arr = _unpermute(arr, n)
        if arch in GGUF_NORM_PLUS_ONE and name.endswith("norm.weight"):
            arr = arr - 1.0
        yield hf, torch.from_numpy(arr)


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights (std 0.02 normal, norms at their neutral value): real shapes, no file."""
    gens: dict = {}
    for name, p in model.named_parameters():
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if "norm" in name:
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            p.fill_(0.0 if getattr(mod, "offset", 0.0) else 1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.02)
