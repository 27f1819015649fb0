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
Device: after the dependency wait (its slot's EXPERT_IN blocks) the routing entry names the expert, as it named it
to the loader (device/ring.py). A slot in use stages moe_act[slot] (bf16, as DOWN_PROJ stages act; a multi-token
step its bf16 copy moe_act16[slot]), dots the expert's row tiles, scales them by slot_w[slot] (each token's own
weight) and stores moe_part[slot, :, rows]; an unused slot consumes no tiles and stores nothing. Every slot then
draws the row block's ticket; the last adds the slots in use, in slot order, to x[:, rows] (and, in a multi-token
step, its bf16 copy x16) and alone signals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import layouts, matvec as mv, matvec_mt as mt
from ..device.context import NO_EXPERT as NO_EXPERT_K
from ..device.context import W_A, W_B, W_C, W_D, W_K0, W_K1, W_LAYER, W_NR
from ..device.sync import routed_read, ticket_is_last
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


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage, sig):
    """One EXPERT_DOWN block of a routing slot on the GPU; returns (it, the counter it signals: ``sig`` for the
    finisher, -1 otherwise, whether hbuf holds this slot's staged input afterwards)."""
    layer = ins.field(W_LAYER)
    slot = ins.field(W_C)
    e = routed_read(b.routed, layer * C.S + slot)
    used = e != NO_EXPERT_K
    if C.M > 1:
        it, sig = _compute_mt(ins, C, s, b, sm, it, restage, sig, layer, slot, used)
    else:
        it, sig = _compute_one(ins, C, s, b, sm, it, restage, sig, layer, slot, used)
    return it, sig, used | (~restage)


@gluon.jit
def _compute_one(ins, C: gl.constexpr, s, b, sm, it, restage, sig, layer, slot, used):
    """One token: moe_part[slot, rows] = slot_w[slot] * (W . moe_act[slot]); the finisher adds the slots to x."""
    row0 = ins.field(W_A)
    n_tiles = ins.field(W_NR)
    RL: gl.constexpr = gl.SliceLayout(1, layouts.tile(C))
    TR: gl.constexpr = C.TR
    offs = gl.arange(0, C.TR, RL)
    if used:
        KT_F: gl.constexpr = C.KT_F
        if restage:
            mv.stage_plain(sm.hbuf, b.moe_act + slot * C.F, C.F, KT_F, C)
        k0 = ins.field(W_K0)
        k1 = ins.field(W_K1)
        w = gl.load(b.slot_w + slot, cache_modifier=".cg")
        for r in range(n_tiles):
            acc, it = mv.dot_tile(sm, it, k0, k1, C)
            gl.store(b.moe_part + slot * C.D + row0 + r * C.TR + offs, w * acc)
    n_slots = ins.field(W_B)
    if ticket_is_last(s.cnt, ins.field(W_D), n_slots, s.epoch):
        for r in range(n_tiles):
            rows = row0 + r * C.TR + offs
            tot = gl.full([TR], 0.0, gl.float32, RL)
            for j in range(n_slots):
                if routed_read(b.routed, layer * C.S + j) != NO_EXPERT_K:
                    tot += gl.load(b.moe_part + j * C.D + rows, cache_modifier=".cg")
            gl.store(b.x + rows, gl.load(b.x + rows, cache_modifier=".cg") + tot)
    else:
        sig = -1
    return it, sig


@gluon.jit
def _compute_mt(ins, C: gl.constexpr, s, b, sm, it, restage, sig, layer, slot, used):
    """Every token of a multi-token step (device/matvec_mt.py): moe_act16[slot] staged, each token's sums scaled by
    its weight for the slot (0 where it did not choose the slot's expert); the finisher adds the slots in use to x
    and its bf16 copy x16."""
    row0 = ins.field(W_A)
    n_tiles = ins.field(W_NR)
    if used:
        k0 = ins.field(W_K0)
        k1 = ins.field(W_K1)
        if restage:
            mt.stage_span(sm.hbuf, b.moe_act16 + slot * (C.M * C.F), C.F, k0, k1, C)
        for r in range(n_tiles):
            rows, t = mt.tile_index(row0 + r * C.TR, C)
            ok = (t < C.M) & (rows >= 0)
            w = gl.load(b.slot_w + slot * C.M + t, mask=t < C.M, other=0.0, cache_modifier=".cg")
            acc, it = mt.dot_tile(sm, it, k0, k1, k0, C)
            gl.store(b.moe_part + (slot * C.M + t) * C.D + rows, w * acc, mask=ok)
    n_slots = ins.field(W_B)
    if ticket_is_last(s.cnt, ins.field(W_D), n_slots, s.epoch):
        for r in range(n_tiles):
            rows, t = mt.tile_index(row0 + r * C.TR, C)
            ok = (t < C.M) & (rows >= 0)
            o = t * C.D + rows
            res = gl.load(b.x + o, mask=ok, other=0.0, cache_modifier=".cg")
            tot = res * 0.0
            for j in range(n_slots):
                if routed_read(b.routed, layer * C.S + j) != NO_EXPERT_K:
                    tot += gl.load(b.moe_part + j * (C.M * C.D) + o, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(b.x + o, res + tot, mask=ok)
            gl.store(b.x16 + o, (res + tot).to(gl.bfloat16), mask=ok)
    else:
        sig = -1
    return it, sig
