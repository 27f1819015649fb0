"""MLP_IN: rows [row0, row0 + nrows) of the gate and up projections, fused with SiLU-and-multiply.

    h          = RMSNorm(x) * mlp_norm                     [M, D]  (rounded to the weight dtype, see common.py)
    act[:, r]  = silu(h . W_gate[r]^T) * (h . W_up[r]^T)   r = the block's rows of I
Writes: act[:, rows]. Reads: all of x (the norm needs whole rows).
Tiles: the gu matrix's 2 * nrows rows of the block (a tile holds TR/2 gate rows then the same TR/2 up rows).
Device: RMSNorm(x) staged once for a run of MLP_IN instructions; every tile row yields TR/2 outputs
silu(gate . h) * (up . h).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import matvec as mv, matvec_mt as mt
from ..device.context import W_A, W_K0, W_K1, W_LAYER, W_NR
from ..isa import Op, RowBlock, TileSpan
from ..tiles import WeightTiles
from .common import OpContext, matvec, rms_norm

OP = Op.MLP_IN


@dataclass(frozen=True)
class MlpIn(RowBlock):
    OP: ClassVar[Op] = Op.MLP_IN


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int) -> TileSpan:
    dense = spec.mlp_layers.index(layer)  # the gu matrix holds the dense layers' MLPs (all of a dense model's)
    return wt.span("gu", 2 * (dense * spec.intermediate_size + row0), 2 * nrows)


def solve(ctx: OpContext, ins: MlpIn) -> None:
    lw, rows = ctx.weights.layers[ins.layer], slice(ins.row0, ins.row0 + ins.nrows)
    h = rms_norm(ctx.scratch.x, lw.mlp_norm, ctx.spec.rms_norm_eps)  # [M, D]
    ctx.scratch.act[:, rows] = F.silu(matvec(h, lw.w_gate[rows])) * matvec(h, lw.w_up[rows])


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage):
    """One MLP_IN block on the GPU; returns it."""
    layer = ins.field(W_LAYER)
    KT_D: gl.constexpr = C.KT_D
    if C.M > 1:
        it = _compute_mt(ins, C, s, b, sm, it, restage, layer)
    else:
        if restage:
            mv.stage_normed(sm.hbuf, b.x, s.emb_row, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D, C)
        it = mv.swiglu_rows(sm, it, ins.field(W_K0), ins.field(W_K1), ins.field(W_NR), b.act + ins.field(W_A), C)
    return it


@gluon.jit
def _compute_mt(ins, C: gl.constexpr, s, b, sm, it, restage, layer):
    """A multi-token MLP_IN block (device/matvec_mt.py): a tile's [TR, MB] sums are TR/2 gate rows over the same
    TR/2 up rows, for every token; SiLU(gate) * up goes to act16 (bf16, as DOWN_PROJ stages it)."""
    KT_D: gl.constexpr = C.KT_D
    if restage:
        mt.stage_normed(sm.hbuf, sm.wbuf, b.x16, b.emb, s.toks, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D, C)
    return mt.swiglu_rows(sm, it, ins.field(W_K0), ins.field(W_K1), ins.field(W_NR), b.act16 + ins.field(W_A), C.I,
                          C)
