"""O_PROJ: rows [row0, row0 + nrows) of the attention output projection plus the residual, for every token.

    x[:, rows] = x_in[:, rows] + attn . W_o[rows]^T         attn [M, Hq*hd], W_o [D, Hq*hd]
x_in is scratch.x as the previous layer's DOWN_PROJ left it, or, in layer 0, the embedding rows of the step's tokens.
Writes: x[:, rows]. Reads: all of attn; x[:, rows] (layer > 0) or weights.embed[tokens, rows] (layer 0).
"""
from __future__ import annotations

from ..isa import OProj
from .common import OpContext, activation_in, matvec, residual


def solve(ctx: OpContext, ins: OProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_o = ctx.weights.layers[ins.layer].wo[rows]  # [n, Hq*hd]
    ctx.scratch.x[:, rows] = residual(ctx, ins.layer, rows) + matvec(activation_in(ctx.scratch.attn, w_o), w_o)
