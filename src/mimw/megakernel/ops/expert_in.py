"""EXPERT_IN: rows [row0, row0 + nrows) of the gate and up projections of the expert in one routing slot, fused with
SiLU-and-multiply, for every token of the step.

    e                     = the expert routed[layer, slot] holds this step (NO_EXPERT: nothing to do)
    h                     = RMSNorm(x) * mlp_norm                                [M, D]  (rounded as in common.py)
    moe_act[slot, :, r]   = silu(h . W_gate[e, r]^T) * (h . W_up[e, r]^T)        r = the block's rows of F
Every token is computed, those that did not choose e included (EXPERT_DOWN weighs them by 0): the expert's weights
are read once for the step.
Writes: moe_act[slot, :, rows]. Reads: routed[layer, slot]; all of x.
Tiles: an expert span (isa.EXPERT_SPAN): the block's 2 * nrows rows of expert 0 in the egu matrix (gate and up
interleaved as in gu), moved by e times the expert stride once the router has run.
Device: none yet (the GPU kernel does not run MoE layers; plan.plan refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from ...models.spec import ModelSpec
from ..isa import NO_EXPERT, Instruction, Op, TileSpan, Word
from ..tiles import WeightTiles
from .common import OpContext, matvec, rms_norm, routed_expert

OP = Op.EXPERT_IN


@dataclass(frozen=True)
class ExpertIn(Instruction):
    OP: ClassVar[Op] = Op.EXPERT_IN
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "row0": Word.A, "nrows": Word.B, "slot": Word.C}
    layer: int = 0
    row0: int = 0  # first output row of F
    nrows: int = 0
    slot: int = 0  # routing slot (isa.SLOT_WORD)


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int) -> TileSpan:
    return wt.expert_span("egu", spec.moe_layers.index(layer), 2 * row0, 2 * nrows)


def solve(ctx: OpContext, ins: ExpertIn) -> None:
    e = routed_expert(ctx, ins.layer, ins.slot)
    if e == NO_EXPERT:
        return
    lw, rows = ctx.weights.layers[ins.layer], slice(ins.row0, ins.row0 + ins.nrows)
    h = rms_norm(ctx.scratch.x, lw.mlp_norm, ctx.spec.rms_norm_eps)  # [M, D]
    ctx.scratch.moe_act[ins.slot, :, rows] = F.silu(matvec(h, lw.e_gate[e, rows])) * matvec(h, lw.e_up[e, rows])
