"""The reference attention math shared by the torch backends (plain and MLA): explicit causal
softmax attention over gathered keys, in float32. Imports nothing of kvfit."""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
           window: int | None = None, softcap: float | None = None,
           key_offset: int = 0, logit_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last q_len positions over all kv positions.

    q [q_len, Hq, D], k/v [kv_len, Hkv, D] -> [q_len, Hq, D]. ``key_offset`` is the absolute
    position of k[0] (non-zero when a pool has dropped tokens that fell out of a window).
    Softmax in float32; GQA by repeating each kv head over its query group. ``logit_shift``
    ``[q_len, Hq]`` is added to every (scaled) logit of its row before the soft-cap (what K
    centering took off, kvcache/kv_transform.py).
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
    if logit_shift is not None:
        s = s + logit_shift.float().transpose(0, 1)[:, :, None]  # [Hq, q_len, 1]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, vf)  # [Hq, q_len, D]
    return o.transpose(0, 1).to(q.dtype)
