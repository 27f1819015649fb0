"""MLP_IN: rows [row0, row0 + nrows) of the gate and up projections, fused with SiLU-and-multiply.

    h          = RMSNorm(x) * mlp_norm                     [M, D]  (rounded to the weight dtype, see common.py)
    act[:, r]  = silu(h . W_gate[r]^T) * (h . W_up[r]^T)   r = the block's rows of I
Writes: act[:, rows]. Reads: all of x (the norm needs whole rows), or with O_PROJ parts all of x_part
(common.x_after_attention).
"""
from __future__ import annotations

import torch.nn.functional as F

from ..isa import MlpIn
from .common import OpContext, matvec, rms_norm, x_after_attention


def solve(ctx: OpContext, ins: MlpIn) -> None:
    lw, rows = ctx.weights.layers[ins.layer], slice(ins.row0, ins.row0 + ins.nrows)
    h = rms_norm(x_after_attention(ctx), lw.mlp_norm, ctx.spec.rms_norm_eps)  # [M, D]
    ctx.scratch.act[:, rows] = F.silu(matvec(h, lw.w_gate[rows])) * matvec(h, lw.w_up[rows])
