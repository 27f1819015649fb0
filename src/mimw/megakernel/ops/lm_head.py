"""LM_HEAD: rows [row0, row0 + nrows) of the vocabulary, after the final norm.

    logits[:, r] = (RMSNorm(x) * final_norm) . W_lm[r]^T    r = the block's vocabulary rows, W_lm [V, D]
Writes: logits[:, rows]. Reads: all of x (after the last layer's DOWN_PROJ). ``layer`` is unused (0).
"""
from __future__ import annotations

from ..isa import LmHead
from .common import OpContext, matvec, rms_norm


def solve(ctx: OpContext, ins: LmHead) -> None:
    w, rows = ctx.weights, slice(ins.row0, ins.row0 + ins.nrows)
    h = rms_norm(ctx.scratch.x, w.final_norm, ctx.spec.rms_norm_eps)  # [M, D]
    ctx.scratch.logits[:, rows] = matvec(h, w.lm_head[rows])
