"""DOWN_PROJ: rows [row0, row0 + nrows) of the MLP down projection plus the residual, for every token.

    x[:, rows] = x[:, rows] + act . W_down[rows]^T      act [M, I], W_down [D, I]
Writes: x[:, rows]. Reads: all of act (a half: its columns); x[:, rows].
A cluster pair (isa.CLUSTER_PAIR, where the row blocks leave half the SMs idle): part p multiplies its column half
of act and W_down into down_part[p, :, rows] (on the GPU: registers, and the exchange slot in shared memory); part
0's finish adds the residual to the two halves' sum, in part order: x = x + (half 0 + half 1).
Ticketed column parts (a multi-token step whose staged act does not fit beside the ring: plan.py): part p of n stores
its sums into down_part[p, :, rows] and draws the row block's ticket; the last to draw adds the residual to the
parts' sum, in part order, and alone signals.
Tensor parallelism (isa.PEER): the rank's partial act_r . W_down[rows, cols_r]^T over its intermediate columns (whole,
or the parts' sum in part order in the finisher), no residual, goes to every rank's DOWN_SUM inbox (peers.py), whose
REDUCE adds the residual.
Tiles: the block's rows of the down matrix, the half's column tiles.
Device: act staged (bf16) once for a run of DOWN_PROJ instructions; a half stages only its own column tiles, from
the staging buffer's first row (so the buffer needs half of I's rows). A pair's row tile: both halves' sums go to
part 0's exchange slot (device/cluster.py), where part 0 adds them to the residual (requested before the tile
loop) and stores x.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import cluster, layouts, matvec as mv, matvec_mt as mt, peer
from ..device.context import W_A, W_C, W_D, W_E, W_K0, W_K1, W_NR
from ..device.sync import counter_wait, ticket_is_last
from ..isa import CLUSTER_PAIR, NO_COUNTER, PEER, Op, RowBlock, TileSpan, Word
from ..peers import DOWN_SUM
from ..tiles import WeightTiles, column_part, column_tiles
from .common import OpContext, activation_in, matvec

OP = Op.DOWN_PROJ


@dataclass(frozen=True)
class DownProj(RowBlock):
    OP: ClassVar[Op] = Op.DOWN_PROJ
    FIELDS: ClassVar[dict[str, Word]] = {**RowBlock.FIELDS, "part": Word.C, "n_parts": Word.D, "ticket": Word.E}
    part: int = 0  # with n_parts > 1 (a cluster pair, or ticketed parts): which column part
    n_parts: int = 0  # 0: every column of the rows, the residual added here

    @property
    def has_finisher(self) -> bool:  # part 0 of a pair, or the last ticketed part: the parts' sum and the residual
        return (bool(self.flags & CLUSTER_PAIR) and self.part == 0) or self.ticket != NO_COUNTER

    @property
    def ticket_count(self) -> int:
        return self.n_parts if self.ticket != NO_COUNTER else 1

    def mate_key(self) -> tuple:
        return self.OP, self.layer, self.row0, self.nrows, self.n_parts


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int, part: int = 0,
         n_parts: int = 0) -> TileSpan:
    k0, k1 = column_tiles(spec.intermediate_size, wt.tile_k, part, max(1, n_parts))
    dense = spec.mlp_layers.index(layer)  # the down matrix holds the dense layers' MLPs
    return wt.span("down", dense * spec.hidden_size + row0, nrows, k0, k1)


def solve(ctx: OpContext, ins: DownProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_down = ctx.weights.layers[ins.layer].w_down[rows]  # [n, I]
    h = activation_in(ctx.scratch.act, w_down)
    if ins.n_parts:
        c0, c1 = column_part(w_down.shape[1], ctx.program.config.tile_k, ins.part, ins.n_parts)
        ctx.scratch.down_part[ins.part, :, rows] = matvec(h[:, c0:c1], w_down[:, c0:c1])
        return
    _store(ctx, ins, rows, matvec(h, w_down))


def finish(ctx: OpContext, ins: DownProj) -> None:
    """Part 0 of a cluster pair once both halves ran, or the last ticketed part: the residual plus the parts' sum,
    in part order."""
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    parts = ctx.scratch.down_part[:, :, rows]
    total = parts[0]
    for p in range(1, ins.n_parts):
        total = total + parts[p]
    _store(ctx, ins, rows, total)


def _store(ctx: OpContext, ins: DownProj, rows: slice, total):
    """The rows' sum [M, n] joins the residual, or (tensor parallelism) goes to every rank's DOWN_SUM inbox."""
    if ins.flags & PEER:
        ctx.peers.send(DOWN_SUM, rows, total)
    else:
        ctx.scratch.x[:, rows] = ctx.scratch.x[:, rows] + total


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, xn, restage, tid, sig):
    """One DOWN_PROJ block (or half, or column part) on the GPU; returns (it, xn, the counter it signals: ``sig``,
    or -1 for a ticketed part that finishes nothing)."""
    row0 = ins.field(W_A)
    k0 = ins.field(W_K0)
    k1 = ins.field(W_K1)
    if C.M > 1:
        it, sig = _compute_mt(ins, C, s, b, sm, it, restage, row0, k0, k1, sig)
    elif C.DOWN_PAIRS:  # every DOWN_PROJ is a cluster pair's half (plan.py)
        KT_H: gl.constexpr = C.KT_H
        if restage:
            mv.stage_span(sm.hbuf, b.act, C.I, k0, k1, KT_H, C)
        if xn == 0:  # the mate's exchange barriers exist before this CTA's first remote store
            counter_wait(s.rdy, gl.program_id(0) ^ 1, s.epoch + 1)
        it, xn = _pair_rows(sm, it, k0, k1, row0, ins.field(W_NR), b, ins.field(W_C), xn, tid, C)
    else:
        KT_I: gl.constexpr = C.KT_I
        if restage:
            mv.stage_plain(sm.hbuf, b.act, C.I, KT_I, C)
        if C.TP > 1:  # the rank's partial to every rank's inbox (device/peer.py)
            it = peer.matvec_rows(sm, it, k0, k1, row0, ins.field(W_NR), b, peer.DOWN_BOX, C)
        else:
            it = mv.residual_rows(sm, it, k0, k1, row0, ins.field(W_NR), b.x, b.x, False, C)
    return it, xn, sig


@gluon.jit
def _compute_mt(ins, C: gl.constexpr, s, b, sm, it, restage, row0, k0, k1, sig):
    """A multi-token block (device/matvec_mt.py): whole rows add the residual here; a ticketed column part
    stores its sums for every token into the parts' scratch (the GPU keeps them in qkv_part's buffer, free from a
    layer's DOWN_PROJ until the next layer's ATTN_IN: state.qkv_part_slots sizes it), draws the row block's ticket, and
    the last part adds the residual to the parts' sum in part order. x and its bf16 copy x16 are written. Returns
    (it, sig)."""
    n_tiles = ins.field(W_NR)
    if restage:
        mt.stage_span(sm.hbuf, b.act16, C.I, k0, k1, C)
    n_parts = ins.field(W_D)
    if n_parts == 0:
        if C.TP > 1:
            it = peer.matvec_rows_mt(sm, it, k0, k1, k0, row0, n_tiles, b, peer.DOWN_BOX, C)
        else:
            it = mt.residual_rows(sm, it, k0, k1, k0, row0, n_tiles, b.x, b.x16, b.emb, s.toks, False, C)
    else:
        part = ins.field(W_C)
        it = mt.part_rows(sm, it, k0, k1, k0, row0, n_tiles, b.qkvp + part * (C.M * C.D), C.D, C)
        if ticket_is_last(s.cnt, ins.field(W_E), n_parts, s.epoch):
            for r in range(n_tiles):
                rows, t = mt.tile_index(row0 + r * C.TR, C)
                ok = (t < C.M) & (rows >= 0)
                o = t * C.D + rows
                if C.TP == 1:
                    res = gl.load(b.x + o, mask=ok, other=0.0, cache_modifier=".cg")
                tot = gl.load(b.qkvp + o, mask=ok, other=0.0, cache_modifier=".cg")
                for p in range(1, n_parts):
                    tot += gl.load(b.qkvp + p * (C.M * C.D) + o, mask=ok, other=0.0, cache_modifier=".cg")
                if C.TP > 1:  # the parts' sum is the rank's partial
                    peer.send(b, peer.DOWN_BOX, t, rows, tot, ok, C)
                else:
                    gl.store(b.x + o, res + tot, mask=ok)
                    gl.store(b.x16 + o, (res + tot).to(gl.bfloat16), mask=ok)
        else:
            sig = -1
    return it, sig


@gluon.jit
def _pair_rows(sm, it, k0, k1, row0, n_tiles, b, part, xn, tid, C: gl.constexpr):
    """A cluster pair's half: each row tile's sums over this half's column tiles [k0, k1) (staged from row 0) go to
    both CTAs' exchange slots (one exchange a row tile, ``xn`` onwards); after the meet, part 0 stores
    x[rows] = x[rows] + (half 0 + half 1), both halves read from its slot in part order (tensor parallelism: sends
    half 0 + half 1 to every rank's inbox); part 1 stores nothing. Returns (it, xn)."""
    x_ptr = b.x
    OWN: gl.constexpr = layouts.thread(C)  # element e: lane e % 32 of every warp
    offs_r = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
    first = part == 0
    for r in range(n_tiles):
        rows = row0 + r * C.TR + offs_r
        if C.TP == 1:
            res = gl.load(x_ptr + rows, mask=(rows >= 0) & first, other=0.0, cache_modifier=".cg")  # in flight now
        acc, it = mv.dot_tile(sm, it, k0, k1, C, True)
        cluster.pair_store(gl.convert_layout(acc, OWN), gl.arange(0, C.TR, OWN), part, xn, C.XB, C.HD)
        cluster.pair_meet(tid, xn, C.XB, C.TR * 4)
        lo = cluster.pair_load(offs_r, 0, xn, C.XB, C.HD)
        hi = cluster.pair_load(offs_r, 1, xn, C.XB, C.HD)
        if C.TP > 1:
            peer.send(b, peer.DOWN_BOX, 0, rows, lo + hi, (rows >= 0) & first, C)
        else:
            gl.store(x_ptr + rows, res + (lo + hi), mask=(rows >= 0) & first)
        xn += 1
    return it, xn
