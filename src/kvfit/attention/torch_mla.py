"""The torch reference of MLA attention in weight-absorbed form, mixed into TorchRefBackend.

Interface for any backend that supports the ``MLAKVCache`` pool (declared by listing it in
``pools``; the start-up guard refuses backends that do not):

``forward_mla(q [T, H, slab], kv [T, slab], layer_id, v_dim) -> [T, H, v_dim]``

* ``kv`` is the step's new slabs ``[c ; k_pe]`` (latent RMS-normed, rope key rotated); they are
  stored first (quantize on store).
* ``q`` is the absorbed query ``[W_UK^T q_nope ; q_pe]`` per head, so that ``q . slab`` equals the
  per-head score ``q_nope . k_nope + q_pe . k_pe`` of the expanded form.
* values are the first ``v_dim`` (= kv_lora_rank) elements of each slab, i.e. the latent ``c``;
  the model applies ``W_UV`` and ``o_proj`` afterwards.

This is MQA with one shared KV "head" of width ``slab``; ``sm_scale`` and ``logit_softcap`` are the
backend's (the model's ``sm_scale(cfg)`` is ``qk_head_dim**-0.5`` with YaRN's mscale).
"""

from __future__ import annotations

import torch

from kvfit.attention.torch_attend import attend


class TorchMLAMixin:
    """Adds ``forward_mla`` to a torch backend (uses ``self.meta``, ``self.pool``, ``sm_scale``)."""

    def forward_mla(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int,
                    v_dim: int) -> torch.Tensor:
        """Store ``kv`` into the MLAKVCache and attend; mutates the pool. See module docstring."""
        meta = self.meta
        if "mla" not in self.pool.layer_kinds:
            raise RuntimeError(f"forward_mla needs a pool of MLA layers (MLAKVCache), got the "
                               f"{self.pool.name} pool")
        self.pool.store_latent(layer_id, kv, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
            if q_len == 0:
                continue
            pages = meta.block_table[i, : meta.num_pages_cpu[i]]
            c = self.pool.gather_latent(layer_id, pages, kv_len, self.compute_dtype)  # [L, slab]
            keys = c[:, None, :]  # [L, 1, slab]
            vals = c[:, None, :v_dim]  # [L, 1, v_dim]
            out[start:start + q_len] = attend(q[start:start + q_len], keys, vals, self.sm_scale,
                                              softcap=self.logit_softcap)
            start += q_len
        return out
