"""ATTN_REDUCE: combine one segment's attention splits for the G query heads of one KV head.

For every token t of the segment and head h of the group, over splits i < n_splits:
    M     = max_i m_i                                  (some split is non-empty: position 0 is always visible)
    w_i   = exp(m_i - M)                               (an empty split has m_i = EMPTY_M, hence w_i = 0)
    out   = sum_i w_i o_i / sum_i w_i l_i              [hd]
Writes: attn[t, h*hd:(h+1)*hd] for the group's heads, i.e. columns [kv_head*G*hd, (kv_head+1)*G*hd).
Reads:  part_o / part_ml[t, h, 0:n_splits] of the segment's tokens and the group's heads.
"""
from __future__ import annotations

import torch

from ..isa import AttnReduce
from .common import OpContext


def combine(ctx: OpContext, kv_head: int, seg: int, n_splits: int) -> torch.Tensor:
    """The group's attention output [T, G*hd] for the segment's T tokens, from splits [0, n_splits)' partials."""
    spec, sc = ctx.spec, ctx.scratch
    g = spec.group_size
    toks, heads = ctx.seg_tokens(seg), slice(kv_head * g, (kv_head + 1) * g)
    o = sc.part_o[toks, heads, :n_splits]  # [T, G, n, hd]
    m, l = sc.part_ml[toks, heads, :n_splits].unbind(-1)  # [T, G, n] each
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [T, G, n]
    out = (w[..., None] * o).sum(-2) / (w * l).sum(-1)[..., None]  # [T, G, hd]
    return out.reshape(out.shape[0], g * spec.head_dim)


def solve(ctx: OpContext, ins: AttnReduce) -> None:
    gh = ctx.spec.group_size * ctx.spec.head_dim
    ctx.scratch.attn[ctx.seg_tokens(ins.seg), ins.kv_head * gh: (ins.kv_head + 1) * gh] = \
        combine(ctx, ins.kv_head, ins.seg, ins.n_splits)
