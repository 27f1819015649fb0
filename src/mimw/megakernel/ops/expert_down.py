"""EXPERT_DOWN: rows [row0, row0 + nrows) of the down projection of the expert in one routing slot, weighted by
each token's routing weight; the finisher (the last slot to draw the row block's ticket) adds each token's chosen
slots' rows to the residual.

solve (every slot):
    e                      = the expert routed[layer, slot] holds this step (NO_EXPERT: nothing to do)
    moe_part[slot, :, r]   = slot_w[slot, :] * (moe_act[slot] . W_down[e, r]^T)   r = the block's rows of D
finish:
    x[t, rows] = x[t, rows] + (sum over token t's chosen slots, in slot order, of moe_part[slot, t, rows])
A token's chosen slots are the slots in use where its weight slot_w[slot, t] is not 0 (at most k of them): the
other slots' parts are 0 (their weight), so the sum is the one over every slot in use. The slots hold the step's
experts in ascending order, so the sum runs over experts in ascending order, as transformers' expert loop adds
them (models/moe.py). Summing in slot order whoever finishes keeps results independent of timing.
Writes: moe_part[slot, :, rows]; the finisher x[:, rows]. Reads: routed[layer, slot], slot_w[slot], moe_act[slot];
the finisher the layer's routing table, slot_w of the slots in use, their moe_part rows and x[:, rows].
Words: ``n_slots`` (Word.B) is the ticket's count; the rows are the span's: nrows = NR * tile_rows.
Tiles: an expert span (isa.EXPERT_SPAN): the block's rows of expert 0 in the edown matrix, every column tile,
moved by e times the expert stride once the router has run.
Device: after the dependency wait (its slot's EXPERT_IN blocks) the routing entry names the expert, as it named it
to the loader (device/ring.py). A slot in use stages moe_act[slot] (bf16, as DOWN_PROJ stages act; a multi-token
step its bf16 copy moe_act16[slot]), dots the expert's row tiles, scales them by slot_w[slot] (each token's own
weight) and stores moe_part[slot, :, rows]; an unused slot consumes no tiles and stores nothing. Every slot then
draws the row block's ticket; the last alone signals, once it has added the slots to x[:, rows] (and, in a
multi-token step, its bf16 copy x16) a row tile at a time, each tile's parts in one load: one token's every slot
in use ([S2, TR]); a multi-token step's each token's chosen slots, found once from the routing table and slot_w
([K2, TR, MB]: k of the up to M * k slots, the rest weigh 0). Each load's parts are a thread's own, added in
slot order. (Reading the routing entry and then the part slot by slot, two dependent L2 round trips a slot and
tile, took the 30B-A3B's decode batch of 8 about 0.6 ms a layer: bench/NOTES.md, "MoE decode batch of 8".)
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


def chosen_slots(ctx: OpContext, layer: int, n_slots: int) -> list[list[int]]:
    """Each token's chosen slots of ``layer``: the slots in use where its weight is not 0, ascending."""
    used, w = active_slots(ctx, layer, n_slots), ctx.scratch.slot_w
    return [[j for j in used if w[j, t] != 0] for t in range(w.shape[1])]


def finish(ctx: OpContext, ins: ExpertDown) -> None:
    """The last slot of the row block: each token's residual plus its chosen slots' rows, in slot order."""
    rows = ins.rows(ctx.program.config.tile_rows)
    parts = ctx.scratch.moe_part[:, :, rows]
    for t, slots in enumerate(chosen_slots(ctx, ins.layer, ins.n_slots)):
        if slots:
            total = parts[slots[0], t]
            for j in slots[1:]:
                total = total + parts[j, t]
            ctx.scratch.x[t, rows] = ctx.scratch.x[t, rows] + total


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
    offs = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
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
    if ticket_is_last(s.cnt, ins.field(W_D), ins.field(W_B), s.epoch):
        _finish_one(C, b, layer, row0, n_tiles)
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
    if ticket_is_last(s.cnt, ins.field(W_D), ins.field(W_B), s.epoch):
        _finish_mt(C, b, layer, row0, n_tiles)
    else:
        sig = -1
    return it, sig


@gluon.jit
def _in_order(parts, k, n: gl.constexpr):
    """The sum over axis 0 of ``parts`` (an axis each thread holds whole, indexed by ``k``), its first ``n`` entries
    added one by one in index order (``finish``'s order: a fixed one, whichever part finishes)."""
    tot = gl.sum(gl.where(k == 0, parts, 0.0), axis=0)
    for i in gl.static_range(1, n):
        tot = tot + gl.sum(gl.where(k == i, parts, 0.0), axis=0)
    return tot


@gluon.jit
def _finish_one(C: gl.constexpr, b, layer, row0, n_tiles):
    """One token's finisher: the routing table read once, then each row tile of every slot in use in one load
    ([S2, TR]), added to x in slot order."""
    L: gl.constexpr = layouts.slot_rows(C)
    j = gl.expand_dims(gl.arange(0, C.S2, gl.SliceLayout(1, L)), 1)  # [S2, 1]
    e = gl.load(b.routed + layer * C.S + j, mask=j < C.S, other=NO_EXPERT_K, cache_modifier=".cg") & NO_EXPERT_K
    used = (j < C.S) & (e != NO_EXPERT_K)
    offs = gl.arange(0, C.TR, gl.SliceLayout(0, L))
    for r in range(n_tiles):
        rows = row0 + r * C.TR + offs
        res = gl.load(b.x + rows, cache_modifier=".cg")
        parts = gl.load(b.moe_part + j * C.D + gl.expand_dims(rows, 0), mask=used, other=0.0, cache_modifier=".cg")
        gl.store(b.x + rows, res + _in_order(parts, j, C.S))


@gluon.jit
def _token_slots(C: gl.constexpr, b, layer):
    """[K2, 1, MB] (``layouts.chosen_parts``): each token's chosen slots, ascending (the slots in use, the layer's
    routing table, where the token's weight is not 0), C.S2 past its last."""
    LW: gl.constexpr = layouts.slot_tokens(C)
    K2: gl.constexpr = layouts.top_k_rows(C)
    j = gl.expand_dims(gl.arange(0, C.S2, gl.SliceLayout(1, LW)), 1)  # [S2, 1]
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, LW)), 0)  # [1, MB]
    e = gl.load(b.routed + layer * C.S + j, mask=j < C.S, other=NO_EXPERT_K, cache_modifier=".cg") & NO_EXPERT_K
    w = gl.load(b.slot_w + j * C.M + t, mask=(j < C.S) & (t < C.M) & (e != NO_EXPERT_K), other=0.0,
                cache_modifier=".cg")
    chosen = w != 0.0  # [S2, MB]
    k = gl.expand_dims(gl.arange(0, K2, gl.SliceLayout(1, LW)), 1)  # [K2, 1]
    idx = k * 0 + t * 0 + C.S2  # [K2, MB]
    prev = gl.max(idx, axis=0) * 0 - 1  # [MB]: the slot chosen last, -1 before the first
    K: gl.constexpr = C.K
    for i in gl.static_range(K):
        nxt = gl.min(gl.where(chosen & (j > gl.expand_dims(prev, 0)), j, C.S2), axis=0)
        idx = gl.where(k == i, gl.expand_dims(nxt, 0), idx)
        prev = nxt
    return gl.expand_dims(gl.convert_layout(idx, gl.SliceLayout(1, layouts.chosen_parts(C))), 1)


@gluon.jit
def _finish_mt(C: gl.constexpr, b, layer, row0, n_tiles):
    """A multi-token step's finisher: each token's chosen slots found once (``_token_slots``), then each row tile of
    them gathered in one load ([K2, TR, MB]: k slots a token, where the others' parts are 0, their weight) and added
    to x (and x16) in slot order. The same sums as adding every slot in use: a part of weight 0 adds nothing."""
    L3: gl.constexpr = layouts.chosen_parts(C)
    K2: gl.constexpr = layouts.top_k_rows(C)
    slot = _token_slots(C, b, layer)  # [K2, 1, MB]
    k = gl.expand_dims(gl.expand_dims(gl.arange(0, K2, gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2)
    r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, C.TR, gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
    t3 = gl.expand_dims(gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    got = (slot < C.S) & (t3 < C.M)  # [K2, 1, MB]
    L2: gl.constexpr = gl.SliceLayout(0, L3)  # [TR, MB]: the tile's sums
    r2 = gl.expand_dims(gl.arange(0, C.TR, gl.SliceLayout(1, L2)), 1)
    t2 = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, L2)), 0)
    for r in range(n_tiles):
        o = t2 * C.D + row0 + r * C.TR + r2
        res = gl.load(b.x + o, mask=t2 < C.M, other=0.0, cache_modifier=".cg")
        parts = gl.load(b.moe_part + (slot * C.M + t3) * C.D + row0 + r * C.TR + r3, mask=got, other=0.0,
                        cache_modifier=".cg")
        x = res + _in_order(parts, k, C.K)
        gl.store(b.x + o, x, mask=t2 < C.M)
        gl.store(b.x16 + o, x.to(gl.bfloat16), mask=t2 < C.M)
