"""Attention over *gathered* pages: each piece's K/V copied out of the paged cache into contiguous tensors, then a
maintained dense kernel. The alternatives that ``mimw bench prefill`` measures against ``paged_attention``:

  ``torch``  the reference decoder's own attention (fp32, blocks of queries: ``mimw.models.reference.attention``);
             any device, the CPU path's choice and the tests' oracle over the same batch.
  ``sdpa``   ``torch.nn.functional.scaled_dot_product_attention`` per piece (FlashAttention-2 on CUDA). A piece
             from position 0 is plain causal attention (GQA without repeating K/V: ``enable_gqa``); a piece after
             a prefix needs the diagonal at the bottom right (``causal_lower_right``: it sees the whole prefix),
             whose dispatch does not take ``enable_gqa`` in every torch release, so its K/V heads are repeated.
  ``cudnn``  cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``) per piece over the pass's
             K/V gathered once (``KeyIndex``), K/V heads repeated for GQA. Its causal mask is square (top left), so
             a piece after a prefix is two calls, its own keys (causal) and the prefix's (no mask), merged by their
             log-sum-exps (``merge_partials``).

The gather costs one read and one write of the piece's K/V per layer (small beside attention's FLOPs at long
contexts) and memory for one pass's contiguous K/V. Over an fp8 cache the gather dequantises each row with its own
scale (``fp8.dequantize``: fp32, exact); ``torch`` attends to those fp32 values (as the reference decoder does over
an fp8 cache), ``sdpa`` and ``cudnn`` to them rounded to q's dtype (``KeyIndex.gather`` for ``cudnn``).
FlexAttention lives in ``flex_attention.py``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

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


@dataclass(frozen=True)
class KeyIndex:
    """Where every key of a pass's pieces lives, the pieces' keys end to end: piece b's key j (position j) is row
    k_start[b] + j of a gathered tensor, read from ``layer[page[i], :, row[i]]``."""

    page: torch.Tensor  # [sum ctx] int64
    row: torch.Tensor  # [sum ctx] int64
    k_start: tuple[int, ...]  # [B + 1]: piece b's keys are rows k_start[b] .. k_start[b+1]

    @classmethod
    def build(cls, batch: PrefillBatch) -> "KeyIndex":
        ps, pages, rows = batch.page_size, [], []
        for p in batch.pieces:
            pos = torch.arange(p.ctx)
            pages.append(torch.tensor(p.block_table[:-(-p.ctx // ps)], dtype=torch.long)[pos // ps])
            rows.append(pos % ps)
        k_start = tuple(itertools.accumulate((p.ctx for p in batch.pieces), initial=0))
        return cls(torch.cat(pages).to(batch.device), torch.cat(rows).to(batch.device), k_start)

    def gather(self, layer: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
        """[P, Hkv, PS, hd] cache layer -> [sum ctx, Hkv, hd] in ``dtype`` (one indexing kernel): a layer of element
        type ``dtype`` as it is, or an fp8 layer with its rows' ``scale`` [P, Hkv, PS] dequantised (fp32, exact)
        and rounded to ``dtype``. A layer of another type without scales is refused (fp8 rows mean nothing
        without theirs)."""
        if scale is not None:  # index through a byte view: float8 indexing is not implemented on every device
            rows = layer.view(torch.uint8)[self.page, :, self.row].view(fp8.FP8)
            return fp8.dequantize(rows, scale[self.page, :, self.row], dtype)
        if layer.dtype != dtype:
            raise ValueError(f"the cache must hold q's dtype ({dtype}), not {layer.dtype}, or come with its scales")
        return layer[self.page, :, self.row].contiguous()


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets, from each set's output and log-sum-exp (natural log, same
    leading shape as the outputs without their last dimension): o = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2),
    in fp32, returned in o1's dtype."""
    w1 = torch.sigmoid(lse1.float() - lse2.float())[..., None]
    o2f = o2.float()
    return (o2f + (o1.float() - o2f) * w1).to(o1.dtype)


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


def _cudnn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, lse: bool):
    """cuDNN's fused attention: q [1, H, L, hd], k/v [1, H, S, hd] -> (o [1, H, L, hd], log-sum-exp [1, H, L, 1] or
    None); ``causal`` is the top-left (square) mask."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False)
    return out[0], out[1]


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, lse: bool):
    """q [L, H, hd], k/v [S, H, hd] -> (o [L, H, hd], log-sum-exp [H, L] fp32 or None)."""
    o, s = _cudnn_op(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, lse)
    return o[0].transpose(0, 1), (s.reshape(q.shape[1], q.shape[0]) if lse else None)


def cudnn_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                    index: KeyIndex, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """cuDNN's fused attention per piece over its gathered K/V (an fp8 cache's dequantised): its own keys
    (causal), and its prefix's (no mask) merged in."""
    g = q.shape[1] // k_layer.shape[1]
    k, v = index.gather(k_layer, q.dtype, k_scale), index.gather(v_layer, q.dtype, v_scale)
    o = torch.empty_like(q)
    for b, p, rows in _rows(batch):
        k0 = index.k_start[b]
        kb = k[k0:k0 + p.ctx].repeat_interleave(g, dim=1)
        vb = v[k0:k0 + p.ctx].repeat_interleave(g, dim=1)
        own, lse_own = _cudnn(q[rows], kb[p.start:], vb[p.start:], True, p.start > 0)
        if p.start == 0:
            o[rows] = own
            continue
        pre, lse_pre = _cudnn(q[rows], kb[:p.start], vb[:p.start], False, True)
        o[rows] = merge_partials(own.transpose(0, 1), lse_own, pre.transpose(0, 1), lse_pre).transpose(0, 1)
    return o


class LibraryAttention:
    """``cudnn_attention`` (a function of the pass's key index) behind the runner's per-pass ``plan``: the key index
    is built once per pass, every layer gathers through it."""

    def __init__(self, fn):
        self.fn = fn

    def plan(self, batch: PrefillBatch):
        index = KeyIndex.build(batch)

        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            return self.fn(q, k_layer, v_layer, batch, index, k_scale, v_scale)

        return run


class GatheredAttention:
    """``torch_attention`` or ``sdpa_attention`` behind the runner's per-pass ``plan``."""

    def __init__(self, fn):
        self.fn = fn

    def plan(self, batch: PrefillBatch):
        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            return self.fn(q, k_layer, v_layer, batch, k_scale, v_scale)

        return run
