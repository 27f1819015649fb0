"""EXPERT_DOWN: rows [row0, row0 + nrows) of the down projection of the expert in one routing slot, weighted by
each token's routing weight; the finisher (the last slot to draw the row block's ticket) adds every slot's rows to
the residual.

solve (every slot):
    e                      = the expert routed[layer, slot] holds this step (NO_EXPERT: nothing to do)
    moe_part[slot, :, r]   = slot_w[slot, :] * (moe_act[slot] . W_down[e, r]^T)   r = the block's rows of D
finish:
    x[:, rows] = x[:, rows] + (sum over the slots in use, in slot order, of moe_part[slot, :, rows])
The slots hold the step's experts in ascending order, so the sum runs over experts in ascending order, as
transformers' expert loop adds them (models/moe.py). Summing in slot order whoever finishes keeps results
independent of timing.
Writes: moe_part[slot, :, rows]; the finisher x[:, rows]. Reads: routed[layer, slot], slot_w[slot], moe_act[slot];
the finisher every slot's moe_part rows and x[:, rows].
Words: ``n_slots`` (Word.B) is the ticket's count; the rows are the span's: nrows = NR * tile_rows.
Tiles: an expert span (isa.EXPERT_SPAN): the block's rows of expert 0 in the edown matrix, every column tile,
moved by e times the expert stride once the router has run.
Device: none yet (the GPU kernel does not run MoE layers; plan.plan refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...models.spec import ModelSpec
from ..isa import NO_COUNTER, NO_EXPERT, Instruction, Op, TileSpan, Word
from ..tiles import WeightTiles
from .common import OpContext, activation_in, matvec, routed_expert

OP = Op.EXPERT_DOWN


@dataclass(frozen=True)
class ExpertDown(Instruction):
    OP: ClassVar[Op] = Op.EXPERT_DOWN
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "row0": Word.A, "n_slots": Word.B, "slot": Word.C,
                                         "ticket": Word.D}
    layer: int = 0
    row0: int = 0
    n_slots: int = 1  # the layer's routing slots: parts that draw the row block's ticket
    slot: int = 0  # routing slot (isa.SLOT_WORD)
    ticket: int = NO_COUNTER

    @property
    def has_finisher(self) -> bool:
        return True

    @property
    def ticket_count(self) -> int:
        return self.n_slots

    def rows(self, tile_rows: int) -> slice:
        """Its rows of D: the span's row tiles."""
        return slice(self.row0, self.row0 + self.tiles.nr * tile_rows)


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int) -> TileSpan:
    return wt.expert_span("edown", spec.moe_layers.index(layer), row0, nrows)


def solve(ctx: OpContext, ins: ExpertDown) -> None:
    e = routed_expert(ctx, ins.layer, ins.slot)
    if e == NO_EXPERT:
        return
    rows = ins.rows(ctx.program.config.tile_rows)
    w_down = ctx.weights.layers[ins.layer].e_down[e, rows]  # [n, F]
    y = matvec(activation_in(ctx.scratch.moe_act[ins.slot], w_down), w_down)  # [M, n]
    ctx.scratch.moe_part[ins.slot, :, rows] = ctx.scratch.slot_w[ins.slot, :, None] * y


def active_slots(ctx: OpContext, layer: int, n_slots: int) -> list[int]:
    """The routing slots of ``layer`` that hold an expert this step (the first ones, in order)."""
    return [j for j in range(n_slots) if routed_expert(ctx, layer, j) != NO_EXPERT]


def finish(ctx: OpContext, ins: ExpertDown) -> None:
    """The last slot of the row block: the residual plus every slot's rows, in slot order."""
    rows = ins.rows(ctx.program.config.tile_rows)
    parts = ctx.scratch.moe_part[:, :, rows]
    total = None
    for j in active_slots(ctx, ins.layer, ins.n_slots):
        total = parts[j] if total is None else total + parts[j]
    ctx.scratch.x[:, rows] = ctx.scratch.x[:, rows] + total
