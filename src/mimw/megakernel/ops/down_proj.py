"""DOWN_PROJ: rows [row0, row0 + nrows) of the MLP down projection plus the residual, for every token.

    x[:, rows] = x_in[:, rows] + act . W_down[rows]^T      act [M, I], W_down [D, I]
x_in is x as this layer's O_PROJ left it, or with O_PROJ parts the sum of x_part (common.x_after_attention).
Writes: x[:, rows]. Reads: all of act; x[:, rows], or x_part[:, :, rows].
"""
from __future__ import annotations

from ..isa import DownProj
from .common import OpContext, activation_in, matvec, x_after_attention


def solve(ctx: OpContext, ins: DownProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_down = ctx.weights.layers[ins.layer].w_down[rows]  # [n, I]
    ctx.scratch.x[:, rows] = x_after_attention(ctx, rows) + matvec(activation_in(ctx.scratch.act, w_down), w_down)
