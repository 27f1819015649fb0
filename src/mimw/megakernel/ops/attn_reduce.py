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


def solve(ctx: OpContext, ins: AttnReduce) -> None:
    spec, sc = ctx.spec, ctx.scratch
    g, hd = spec.group_size, spec.head_dim
    toks, heads = ctx.seg_tokens(ins.seg), slice(ins.kv_head * g, (ins.kv_head + 1) * g)
    o = sc.part_o[toks, heads, : ins.n_splits]  # [T, G, n, hd]
    m, l = sc.part_ml[toks, heads, : ins.n_splits].unbind(-1)  # [T, G, n] each
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [T, G, n]
    out = (w[..., None] * o).sum(-2) / (w * l).sum(-1)[..., None]  # [T, G, hd]
    sc.attn[toks, ins.kv_head * g * hd: (ins.kv_head + 1) * g * hd] = out.reshape(out.shape[0], g * hd)
