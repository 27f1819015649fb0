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
Device: after the dependency wait (the router's signal) the routing entry names the expert, as it named it to the
loader (device/ring.py); an unused slot consumes no tiles and writes nothing. Otherwise as MLP_IN: RMSNorm(x)
staged (or still staged by the layer's ROUTER part just before: the kernel keys the staging of both by the layer),
each tile row yielding TR/2 outputs silu(gate . h) * (up . h), stored to moe_act[slot] (one token), or for every
token of a multi-token step to its bf16 copy moe_act16[slot], which EXPERT_DOWN stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import matvec as mv, matvec_mt as mt
from ..device.context import NO_EXPERT as NO_EXPERT_K
from ..device.context import W_A, W_C, W_K0, W_K1, W_LAYER, W_NR
from ..device.sync import routed_read
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


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage):
    """One EXPERT_IN block of a routing slot on the GPU; returns (it, whether hbuf holds the layer's staged input
    afterwards: not where an unused slot skipped the staging)."""
    layer = ins.field(W_LAYER)
    slot = ins.field(W_C)
    e = routed_read(b.routed, layer * C.S + slot)
    used = e != NO_EXPERT_K
    if used:
        KT_D: gl.constexpr = C.KT_D
        row0 = ins.field(W_A)
        k0 = ins.field(W_K0)
        k1 = ins.field(W_K1)
        if C.M > 1:
            it = _compute_mt(ins, C, s, b, sm, it, restage, layer, slot, row0, k0, k1)
        else:
            if restage:
                mv.stage_normed(sm.hbuf, b.x, s.emb_row, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D, C)
            it = mv.swiglu_rows(sm, it, k0, k1, ins.field(W_NR), b.moe_act + slot * C.F + row0, C)
    return it, used | (~restage)


@gluon.jit
def _compute_mt(ins, C: gl.constexpr, s, b, sm, it, restage, layer, slot, row0, k0, k1):
    """A multi-token block (MLP_IN's, mlp_in._compute_mt): SiLU(gate) * up of every token to moe_act16[slot] (bf16,
    as EXPERT_DOWN stages it)."""
    KT_D: gl.constexpr = C.KT_D
    if restage:
        mt.stage_normed(sm.hbuf, sm.wbuf, b.x16, b.emb, s.toks, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D, C)
    return mt.swiglu_rows(sm, it, k0, k1, ins.field(W_NR), b.moe_act16 + slot * (C.M * C.F) + row0, C.F, C)
