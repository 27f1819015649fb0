"""O_PROJ: rows [row0, row0 + nrows) of the attention output projection plus the residual, for every token.

    x[:, rows] = x_in[:, rows] + attn . W_o[rows]^T         attn [M, Hq*hd], W_o [D, Hq*hd]
x_in is scratch.x as the previous layer's DOWN_PROJ left it, or, in layer 0, the embedding rows of the step's tokens.
Writes: x[:, rows]. Reads: all of attn; x[:, rows] (layer > 0) or weights.embed[tokens, rows] (layer 0).

With ``n_parts`` > 0 (ProgramConfig.o_parts) the instruction is column part ``part``: the columns of KV groups
[part * Hkv / n_parts, (part + 1) * Hkv / n_parts). It combines those groups' attention splits itself (as
ATTN_REDUCE does, every segment's; the combined output is rounded to the weight dtype like attn) and stores

    x_part[part][:, rows] = (part 0: x_in[:, rows]) + attn[:, cols] . W_o[rows, cols]^T
Writes: x_part[part][:, rows]. Reads: part_o / part_ml of its groups' heads, splits [0, n_splits), every token;
x_in[:, rows] (part 0 only).
"""
from __future__ import annotations

import torch

from ..isa import OProj
from .attn_reduce import combine
from .common import OpContext, activation_in, matvec, residual


def solve(ctx: OpContext, ins: OProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_o = ctx.weights.layers[ins.layer].wo[rows]  # [n, Hq*hd]
    if not ins.n_parts:
        ctx.scratch.x[:, rows] = residual(ctx, ins.layer, rows) + matvec(activation_in(ctx.scratch.attn, w_o), w_o)
        return
    spec = ctx.spec
    gpp, gh = spec.num_kv_heads // ins.n_parts, spec.group_size * spec.head_dim
    groups = range(ins.part * gpp, (ins.part + 1) * gpp)
    attn = torch.cat([torch.cat([combine(ctx, k, s, ins.n_splits) for s in range(len(ctx.program.shape.seg_lens))])
                      for k in groups], dim=1)  # [M, gpp * G * hd]
    w = w_o[:, groups.start * gh: groups.stop * gh]
    out = matvec(activation_in(attn, w), w)
    if ins.part == 0:
        out = residual(ctx, ins.layer, rows) + out
    ctx.scratch.x_part[ins.part, :, rows] = out
