"""DOWN_PROJ: rows [row0, row0 + nrows) of the MLP down projection plus the residual, for every token.

    x[:, rows] = x_in[:, rows] + act . W_down[rows]^T      act [M, I], W_down [D, I]
x_in is x as this layer's O_PROJ left it, or with O_PROJ parts the sum of x_part (common.x_after_attention).
Writes: x[:, rows]. Reads: all of act; x[:, rows], or x_part[:, :, rows].
A cluster pair (ProgramConfig.cluster_down, isa.CLUSTER_PAIR): part p multiplies its column half of act and W_down
into down_part[p, :, rows] (on the GPU: registers, and the exchange slot in shared memory); part 0's finish adds
the residual to the two halves' sum, in part order: x = x_in + (half 0 + half 1).
"""
from __future__ import annotations

from ..isa import DownProj
from ..program import column_part
from .common import OpContext, activation_in, matvec, x_after_attention


def solve(ctx: OpContext, ins: DownProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_down = ctx.weights.layers[ins.layer].w_down[rows]  # [n, I]
    h = activation_in(ctx.scratch.act, w_down)
    if ins.n_parts:
        c0, c1 = column_part(w_down.shape[1], ctx.program.config.tile_k, ins.part, ins.n_parts)
        ctx.scratch.down_part[ins.part, :, rows] = matvec(h[:, c0:c1], w_down[:, c0:c1])
        return
    ctx.scratch.x[:, rows] = x_after_attention(ctx, rows) + matvec(h, w_down)


def finish(ctx: OpContext, ins: DownProj) -> None:
    """Part 0 of a cluster pair, once both halves ran: the residual plus the halves' sum."""
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    halves = ctx.scratch.down_part[:, :, rows]
    ctx.scratch.x[:, rows] = x_after_attention(ctx, rows) + (halves[0] + halves[1])
