"""The torch reference backend: the oracle every kernel is tested against. CPU and CUDA.

For each request it gathers the request's pages, dequantizes them to the compute dtype (applying
the per-tensor scale), and runs explicit softmax attention with a causal mask that accounts for
the cached prefix: query j of a request with q_len new tokens and kv_len cached tokens sits at
absolute position ``kv_len - q_len + j`` and sees keys ``0 .. kv_len - q_len + j`` (and, on a
sliding-window layer, only the last ``window`` of those).
"""

from __future__ import annotations

import torch

from kvfit.attention.base import AttentionBackend
from kvfit.attention.torch_mla import TorchMLAMixin
from kvfit.kvcache.dtypes import KV_FORMATS


class TorchRefBackend(TorchMLAMixin, AttentionBackend):
    name = "torch"
    devices = frozenset({"cpu", "cuda"})
    pools = frozenset({"MHAKVCache", "HybridSWAKVCache", "MLAKVCache"})
    kv_dtypes = frozenset(KV_FORMATS)
    page_sizes = None
    head_dims = None
    supports_cuda_graph = False

    def forward(self, q, k, v, layer_id):
        meta = self.meta
        spec = self.pool.layers[layer_id]
        window = spec.window if spec.kind == "sliding" else None
        slots, table, num_pages = meta.slot_mapping, meta.block_table, meta.num_pages_cpu
        first_live = None
        if window is not None and getattr(self.pool, "windowed", False):
            # sliding layers live in their own page space (see kvcache/hybrid_swa.py)
            swa = getattr(meta, "swa", None)
            if swa is None:
                raise RuntimeError("HybridSWAKVCache needs HybridAttentionMetadata (build it with "
                                   "kvfit.kvcache.hybrid_swa.build_hybrid_metadata)")
            slots, table, num_pages, first_live = (swa.slot_mapping, swa.block_table,
                                                    swa.num_pages_cpu, swa.first_live_cpu)
        self.pool.store_kv(layer_id, k, v, slots)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
            if q_len == 0:
                continue
            first = 0 if first_live is None else first_live[i]  # gather only the live window
            pages = table[i, first: num_pages[i]]
            offset = first * self.pool.page_size
            kk, vv = self.pool.gather_kv(layer_id, pages, kv_len - offset, self.compute_dtype)
            out[start:start + q_len] = attend(q[start:start + q_len], kk, vv, self.sm_scale,
                                              window=window, softcap=self.logit_softcap,
                                              key_offset=offset)
            start += q_len
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
           window: int | None = None, softcap: float | None = None,
           key_offset: int = 0) -> torch.Tensor:
    """Causal attention of the last q_len positions over all kv positions.

    q [q_len, Hq, D], k/v [kv_len, Hkv, D] -> [q_len, Hq, D]. ``key_offset`` is the absolute
    position of k[0] (non-zero when a pool has dropped tokens that fell out of a window).
    Softmax in float32; GQA by repeating each kv head over its query group.
    """
    q_len, hq, _ = q.shape
    kv_len, hkv, _ = k.shape
    group = hq // hkv
    total = key_offset + kv_len  # absolute length of the sequence after this step
    qpos = torch.arange(total - q_len, total, device=q.device)[:, None]  # [q_len, 1]
    kpos = torch.arange(key_offset, total, device=q.device)[None, :]  # [1, kv_len]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    qf = q.float().transpose(0, 1)  # [Hq, q_len, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, kv_len, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [Hq, q_len, kv_len]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, vf)  # [Hq, q_len, D]
    return o.transpose(0, 1).to(q.dtype)
