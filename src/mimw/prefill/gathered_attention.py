"""Attention over *gathered* pages: each piece's K/V copied out of the paged cache into contiguous tensors, then a
maintained dense kernel. The alternatives that ``mimw bench prefill`` measures against ``paged_attention``:

  ``torch``  the reference decoder's own attention (fp32, blocks of queries: ``mimw.models.reference.attention``);
             any device, the CPU path's choice and the tests' oracle over the same batch.
  ``sdpa``   ``torch.nn.functional.scaled_dot_product_attention`` per piece (FlashAttention-2 on CUDA). A piece
             from position 0 is plain causal attention (GQA without repeating K/V: ``enable_gqa``); a piece after
             a prefix needs the diagonal at the bottom right (``causal_lower_right``: it sees the whole prefix),
             whose dispatch does not take ``enable_gqa`` in every torch release, so its K/V heads are repeated.

The gather costs one read and one write of the piece's K/V per layer (small beside attention's FLOPs at long
contexts) and memory for one piece's contiguous K/V. Over an fp8 cache the gather dequantises each row with its own
scale (``fp8.dequantize``: fp32, exact); ``torch`` attends to those fp32 values (as the reference decoder does over
an fp8 cache), ``sdpa`` to them rounded to q's dtype. FlexAttention lives in ``flex_attention.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..kv import fp8
from ..models import reference
from .batch import PrefillBatch


def gather(layer: torch.Tensor, batch: PrefillBatch, b: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Piece b's K or V for positions 0..ctx-1 from a [P, Hkv, PS, hd] cache layer -> [Hkv, ctx, hd]: the layer's
    dtype, or for an fp8 layer with its rows' ``scale`` [P, Hkv, PS] bf16 dequantised to fp32."""
    p = batch.pieces[b]
    n = -(-p.ctx // batch.page_size)
    pages = batch.block_tables[b, :n].long()
    if scale is not None:  # index through a byte view: float8 indexing is not implemented on every device
        x = fp8.dequantize(layer.view(torch.uint8)[pages].view(fp8.FP8), scale[pages])
    else:
        x = layer[pages]
    x = x.transpose(0, 1)  # [Hkv, n, PS, hd]
    return x.reshape(x.shape[0], n * batch.page_size, x.shape[-1])[:, :p.ctx]


def _rows(batch: PrefillBatch):
    r0 = 0
    for b, p in enumerate(batch.pieces):
        yield b, p, slice(r0, r0 + p.length)
        r0 += p.length


def torch_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference decoder's attention over each piece's gathered K/V (as the reference reads them: the cache's
    dtype cast to q's, or an fp8 cache's rows dequantised to fp32)."""
    o = torch.empty_like(q)
    dt = torch.float32 if k_scale is not None else q.dtype
    for b, p, rows in _rows(batch):
        k = gather(k_layer, batch, b, k_scale).transpose(0, 1).to(dt)  # [ctx, Hkv, hd]
        v = gather(v_layer, batch, b, v_scale).transpose(0, 1).to(dt)
        o[rows] = reference.attention(q[rows], k, v, batch.positions[rows])
    return o


def sdpa_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` per piece over its gathered K/V (an fp8 cache's dequantised)."""
    o = torch.empty_like(q)
    for b, p, rows in _rows(batch):
        k = gather(k_layer, batch, b, k_scale).to(q.dtype)[None]  # [1, Hkv, ctx, hd]
        v = gather(v_layer, batch, b, v_scale).to(q.dtype)[None]
        qb = q[rows].transpose(0, 1)[None]  # [1, Hq, L, hd]
        if p.start == 0:
            out = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            out = F.scaled_dot_product_attention(qb, k, v, attn_mask=causal_lower_right(p.length, p.ctx))
        o[rows] = out[0].transpose(0, 1)
    return o


class GatheredAttention:
    """``torch_attention`` or ``sdpa_attention`` behind the runner's per-pass ``plan``."""

    def __init__(self, fn):
        self.fn = fn

    def plan(self, batch: PrefillBatch):
        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            return self.fn(q, k_layer, v_layer, batch, k_scale, v_scale)

        return run
