"""The plain PyTorch prefill the issue measures mimw against: eager PyTorch, one call over the whole prompt, the
reference decoder's numerics (RMSNorm and RoPE in fp32 from ``mimw.models``) with separate q/k/v and gate/up
projections, and ``scaled_dot_product_attention`` (FlashAttention-2 on CUDA, causal, GQA without repeating K/V).
No paged cache: K and V live only inside each layer's call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import rope
from ..models.reference import rms_norm
from ..models.weights import ModelWeights


@torch.no_grad()
def plain_sdpa_prefill(w: ModelWeights, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [n] on the weights' device -> fp32 logits [V] of the last token."""
    spec = w.spec
    n, eps = tokens.numel(), spec.rms_norm_eps
    hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    cos, sin = rope.cos_sin(spec, torch.arange(n, device=tokens.device))
    x = F.embedding(tokens, w.embed)
    for lw in w.layers:
        h = rms_norm(x, lw.attn_norm, eps)
        q = F.linear(h, lw.wq, lw.bq).view(n, hq, hd)
        k = F.linear(h, lw.wk, lw.bk).view(n, hkv, hd)
        v = F.linear(h, lw.wv, lw.bv).view(n, hkv, hd)
        if spec.qk_norm:
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        x = x + F.linear(o[0].transpose(0, 1).reshape(n, hq * hd), lw.wo)
        h = rms_norm(x, lw.mlp_norm, eps)
        x = x + F.linear(F.silu(F.linear(h, lw.w_gate)) * F.linear(h, lw.w_up), lw.w_down)
    return F.linear(rms_norm(x[-1:], w.final_norm, eps), w.lm_head).float()[0]
