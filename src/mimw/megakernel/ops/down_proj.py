"""DOWN_PROJ: rows [row0, row0 + nrows) of the MLP down projection plus the residual, for every token.

    x[:, rows] += act . W_down[rows]^T                     act [M, I], W_down [D, I]
Writes: x[:, rows]. Reads: all of act; x[:, rows] (as this layer's O_PROJ left it).
"""
from __future__ import annotations

from ..isa import DownProj
from .common import OpContext, activation_in, matvec


def solve(ctx: OpContext, ins: DownProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_down = ctx.weights.layers[ins.layer].w_down[rows]  # [n, I]
    ctx.scratch.x[:, rows] = ctx.scratch.x[:, rows] + matvec(activation_in(ctx.scratch.act, w_down), w_down)
