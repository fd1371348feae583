"""Fold the per-head Hadamard rotation of V into the attention weights (int8 KV, issue 14).

With ``H`` the normalized Hadamard matrix (symmetric, orthonormal, kvcache/kv_transform.py),
each KV head's value ``v_h = W_h x + b_h`` becomes ``v_h @ H = (H W_h) x + H b_h``: the rows of
that head in ``v_proj`` (and its bias) are multiplied by H from the left. Attention is linear in
V, so every query head's output comes out rotated too, ``o_j @ H``, and ``o_proj``'s columns of
query head j are multiplied by H from the right: ``W_o[:, j] H (H o_j) = W_o[:, j] o_j``. V has no
RoPE, so no runtime rotation of V is needed; K's rotation follows RoPE and runs at attention
time (``KVTransform.transform_qk``).
"""

from __future__ import annotations

import torch
from torch import nn

from kvfit.kvcache.kv_transform import hadamard


def rotation_fold_targets(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose V can be folded: those with a fused ``qkv_proj`` ([q; k; v]
    rows) and an ``o_proj`` (models/llama.py ``Attention``, also used by gemma3.py). Raises
    ValueError when the model has attention layers of another kind (e.g. MLA)."""
    found = [m for m in model.modules() if hasattr(m, "qkv_proj") and hasattr(m, "o_proj")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no qkv_proj/o_proj attention to fold a V "
                         "rotation into; int8 KV is not available for this model")
    return found


@torch.no_grad()
def fold_v_rotation(model: nn.Module) -> int:
    """Rotate every attention layer's V output by H per KV head and un-rotate it in o_proj.
    Mutates the weights in place (computed in float64, stored in the weights' dtype); returns
    the number of layers folded."""
    layers = rotation_fold_targets(model)
    for attn in layers:
        d, hkv, hq = attn.head_dim, attn.num_kv_heads, attn.num_heads
        h = hadamard(d).double().to(attn.qkv_proj.weight.device)
        v0 = attn.q_size + attn.kv_size  # first v row of the fused projection
        w = attn.qkv_proj.weight
        wv = w[v0:v0 + attn.kv_size].double().view(hkv, d, -1)  # [Hkv, D, in]
        w[v0:v0 + attn.kv_size] = torch.matmul(h, wv).reshape(hkv * d, -1).to(w.dtype)
        b = attn.qkv_proj.bias
        if b is not None:
            bv = b[v0:v0 + attn.kv_size].double().view(hkv, d)  # [Hkv, D]
            b[v0:v0 + attn.kv_size] = torch.matmul(bv, h).reshape(-1).to(b.dtype)  # H b = b H
        wo = attn.o_proj.weight  # [hidden, Hq * D]
        wo_h = wo.double().view(wo.shape[0], hq, d)  # [hidden, Hq, D]
        wo.copy_(torch.matmul(wo_h, h).reshape(wo.shape[0], hq * d).to(wo.dtype))
    return len(layers)
