"""O_PROJ: rows [row0, row0 + nrows) of the attention output projection plus the residual, for every token.

    x[:, rows] = x_in[:, rows] + attn . W_o[rows]^T         attn [M, Hq*hd], W_o [D, Hq*hd]
x_in is scratch.x as the previous layer's DOWN_PROJ left it, or, in layer 0, the embedding rows of the step's tokens.
Writes: x[:, rows]. Reads: all of attn; x[:, rows] (layer > 0) or weights.embed[tokens, rows] (layer 0).
Tensor parallelism (isa.PEER): the rank's partial attn_r . W_o[rows, cols_r]^T over its heads' columns, no residual,
goes to every rank's O_SUM inbox (peers.py), whose REDUCE adds the residual; x is not written here.
Tiles: the block's rows of the o matrix, every column tile.
Device: the attention output staged (bf16) once for a run of O_PROJ instructions, then row tile by row tile the
residual (requested first) plus the tile's dot product.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import matvec as mv, matvec_mt as mt, peer
from ..device.context import W_A, W_K0, W_K1, W_LAYER, W_NR
from ..isa import PEER, Op, RowBlock, TileSpan
from ..peers import O_SUM
from ..tiles import WeightTiles
from .common import OpContext, activation_in, matvec, residual

OP = Op.O_PROJ


@dataclass(frozen=True)
class OProj(RowBlock):
    OP: ClassVar[Op] = Op.O_PROJ


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int) -> TileSpan:
    return wt.span("o", layer * spec.hidden_size + row0, nrows)


def solve(ctx: OpContext, ins: OProj) -> None:
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    w_o = ctx.weights.layers[ins.layer].wo[rows]  # [n, Hq*hd]
    out = matvec(activation_in(ctx.scratch.attn, w_o), w_o)
    if ins.flags & PEER:
        ctx.peers.send(O_SUM, rows, out)
        return
    ctx.scratch.x[:, rows] = residual(ctx, ins.layer, rows) + out


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage):
    """One O_PROJ block on the GPU; returns it."""
    layer = ins.field(W_LAYER)
    KT_Q: gl.constexpr = C.KT_Q
    if C.M > 1:  # every token's row (device/matvec_mt.py)
        if restage:
            mt.stage_span(sm.hbuf, b.attn16, C.HQ * C.HD, 0, KT_Q, C)
        if C.TP > 1:  # the rank's partial to every rank's inbox (device/peer.py)
            return peer.matvec_rows_mt(sm, it, ins.field(W_K0), ins.field(W_K1), 0, ins.field(W_A), ins.field(W_NR),
                                       b, peer.O_BOX, C)
        it = mt.residual_rows(sm, it, ins.field(W_K0), ins.field(W_K1), 0, ins.field(W_A), ins.field(W_NR), b.x,
                              b.x16, b.emb, s.toks, layer == 0, C)
    else:
        if restage:
            mv.stage_plain(sm.hbuf, b.attn, C.HQ * C.HD, KT_Q, C)
        if C.TP > 1:
            return peer.matvec_rows(sm, it, ins.field(W_K0), ins.field(W_K1), ins.field(W_A), ins.field(W_NR), b,
                                    peer.O_BOX, C)
        it = mv.residual_rows(sm, it, ins.field(W_K0), ins.field(W_K1), ins.field(W_A), ins.field(W_NR), b.x,
                              s.emb_row, layer == 0, C)
    return it
