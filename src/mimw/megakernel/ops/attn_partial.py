"""ATTN_PARTIAL: attention of one segment's query tokens over one split of its context, for the G query heads
that share one KV head.

    ctx = seg_ctx[seg];  [lo, hi) = split_range(ctx, split, n_splits)       (possibly empty)
    for every query token t of the segment (position p_t) and query head h of the group (h = kv_head*G + j):
        s_j   = (q[t, h] . K[j]) * hd^-0.5        for j in [lo, hi), masked out where j > p_t (causal)
        m     = max_j s_j                       (EMPTY_M when no j survives)
        l     = sum_j exp(s_j - m)
        o     = sum_j exp(s_j - m) V[j]         [hd]
Writes: part_o[t, h, split, :] = o, part_ml[t, h, split] = (m, l); an empty split (or one fully masked for token t)
        stores (EMPTY_M, 0) and o = 0.
Reads:  q[t, h] for the segment's tokens and the group's heads; K/V of layer ``layer``, kv head ``kv_head`` at
        positions [lo, hi) through the segment's block table (positions of this step were stored by ATTN_IN).
        An empty split reads nothing.
"""
from __future__ import annotations

import torch

from ..isa import AttnPartial
from ..state import EMPTY_M, split_range
from .common import OpContext


def solve(ctx: OpContext, ins: AttnPartial) -> None:
    spec, sc = ctx.spec, ctx.scratch
    g, hd = spec.group_size, spec.head_dim
    toks, heads = ctx.seg_tokens(ins.seg), slice(ins.kv_head * g, (ins.kv_head + 1) * g)
    lo, hi = split_range(int(ctx.state.seg_ctx[ins.seg]), ins.split, ins.n_splits)
    if lo == hi:
        sc.part_o[toks, heads, ins.split] = 0.0
        sc.part_ml[toks, heads, ins.split, 0] = EMPTY_M
        sc.part_ml[toks, heads, ins.split, 1] = 0.0
        return
    ps = ctx.cache.layout.page_size
    pos = torch.arange(lo, hi)  # [S]
    pages, rows = ctx.state.block_tables[ins.seg].long()[pos // ps], pos % ps
    k = ctx.cache.k[ins.layer, pages, ins.kv_head, rows].float()  # [S, hd]
    v = ctx.cache.v[ins.layer, pages, ins.kv_head, rows].float()  # [S, hd]
    q = sc.q[toks, heads]  # [T, G, hd]
    s = (q @ k.t()) * hd ** -0.5  # [T, G, S]
    q_pos = ctx.state.positions[toks].long()  # [T]
    if hi - 1 > int(q_pos.min()):  # some key lies in some query token's future
        s = s.masked_fill((pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    m = s.amax(-1)  # [T, G]; -inf where the whole split is in token t's future
    empty = torch.isneginf(m)
    p = torch.exp(s - m.masked_fill(empty, 0.0)[..., None])  # masked -> exp(-inf) = 0
    sc.part_o[toks, heads, ins.split] = p @ v
    sc.part_ml[toks, heads, ins.split, 0] = m.masked_fill(empty, EMPTY_M)
    sc.part_ml[toks, heads, ins.split, 1] = p.sum(-1)
