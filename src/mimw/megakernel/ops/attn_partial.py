"""ATTN_PARTIAL: attention of one segment's query tokens over one split of its context, for the G query heads
that share one KV head.

    ctx = seg_ctx[seg];  [lo, hi) = split_range(ctx, split, n_splits, seg_len)   (possibly empty; the last
    split holds the segment's new positions)
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
With isa.QKV_IN_ATTN (a non-empty split): q and this step's K/V rows come from ATTN_IN's column parts instead,
        finished here (attn_in.finish_rows: part order, bias, q/k norm, RoPE); the split stores the step's K/V
        rows at its own positions [lo, hi) to the cache (rounded to the cache dtype), then reads the cache as
        above. Reads: qkv_part of the group's q heads and of the K and V heads, all ``n_parts`` parts.
"""
from __future__ import annotations

import torch

from ..isa import QKV_IN_ATTN, AttnPartial
from ..state import EMPTY_M, split_range
from .attn_in import finish_rows, kv_slots
from .common import OpContext


def solve(ctx: OpContext, ins: AttnPartial) -> None:
    spec, sc = ctx.spec, ctx.scratch
    g, hd = spec.group_size, spec.head_dim
    toks, heads = ctx.seg_tokens(ins.seg), slice(ins.kv_head * g, (ins.kv_head + 1) * g)
    lo, hi = split_range(int(ctx.state.seg_ctx[ins.seg]), ins.split, ins.n_splits, toks.stop - toks.start)
    if lo == hi:
        sc.part_o[toks, heads, ins.split] = 0.0
        sc.part_ml[toks, heads, ins.split, 0] = EMPTY_M
        sc.part_ml[toks, heads, ins.split, 1] = 0.0
        return
    q = _finish_group(ctx, ins, toks, lo, hi) if ins.flags & QKV_IN_ATTN else sc.q[toks, heads]  # [T, G, hd]
    ps = ctx.cache.layout.page_size
    pos = torch.arange(lo, hi)  # [S]
    pages, rows = ctx.state.block_tables[ins.seg].long()[pos // ps], pos % ps
    k = ctx.cache.k[ins.layer, pages, ins.kv_head, rows].float()  # [S, hd]
    v = ctx.cache.v[ins.layer, pages, ins.kv_head, rows].float()  # [S, hd]
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


def _finish_group(ctx: OpContext, ins: AttnPartial, toks: slice, lo: int, hi: int) -> torch.Tensor:
    """isa.QKV_IN_ATTN: q [T, G, hd] of the segment's tokens and the group's heads from ATTN_IN's parts; the
    segment's K/V rows of this step whose positions fall in [lo, hi) are stored to the cache."""
    spec = ctx.spec
    g, hq, hkv = spec.group_size, spec.num_heads, spec.num_kv_heads
    q = torch.stack([finish_rows(ctx, ins.layer, ins.kv_head * g + j, ins.n_parts) for j in range(g)], dim=1)
    positions = ctx.state.positions.long()
    mine = torch.zeros_like(positions, dtype=torch.bool)
    mine[toks] = (positions[toks] >= lo) & (positions[toks] < hi)
    if bool(mine.any()):
        pages, slots = kv_slots(ctx, positions)
        for pool, head in ((ctx.cache.k, hq + ins.kv_head), (ctx.cache.v, hq + hkv + ins.kv_head)):
            y = finish_rows(ctx, ins.layer, head, ins.n_parts)
            pool[ins.layer, pages[mine], ins.kv_head, slots[mine]] = y[mine].to(pool.dtype)
    return q[toks]
