"""LM_HEAD: rows [row0, row0 + nrows) of the vocabulary, after the final norm.

    logits[:, r] = (RMSNorm(x) * final_norm) . W_lm[r]^T    r = the block's vocabulary rows, W_lm [V, D]
Writes: logits[:, rows]. Reads: all of x (after the last layer's DOWN_PROJ). ``layer`` is unused (0). It signals
no counter: nobody waits for the logits inside the step (the launch's end publishes them).
Tensor parallelism (isa.PEER): the rows are of the rank's V/N vocabulary rows; their logits go to every rank's
LM_GATHER inbox (peers.py) instead, and signal the rows' peer counter there; each rank's gathering REDUCE copies them
to this rank's columns of its logits.
Tiles: the block's rows of the lm matrix, every column tile.
Device: RMSNorm(x) staged once for a run of LM_HEAD instructions, then a row tile's logits per tile row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from ..device import layouts, matvec as mv, matvec_mt as mt, peer
from ..device.context import W_A, W_K0, W_K1, W_NR
from ..isa import PEER, Op, RowBlock, TileSpan
from ..peers import LM_GATHER
from ..tiles import WeightTiles
from .common import OpContext, matvec, rms_norm

OP = Op.LM_HEAD


@dataclass(frozen=True)
class LmHead(RowBlock):
    OP: ClassVar[Op] = Op.LM_HEAD


def span(spec: ModelSpec, wt: WeightTiles, row0: int, nrows: int) -> TileSpan:
    return wt.span("lm", row0, nrows)


def solve(ctx: OpContext, ins: LmHead) -> None:
    w, rows = ctx.weights, slice(ins.row0, ins.row0 + ins.nrows)
    h = rms_norm(ctx.scratch.x, w.final_norm, ctx.spec.rms_norm_eps)  # [M, D]
    out = matvec(h, w.lm_head[rows])
    if ins.flags & PEER:
        ctx.peers.send(LM_GATHER, rows, out)
        return
    ctx.scratch.logits[:, rows] = out


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage):
    """One LM_HEAD block on the GPU; returns it."""
    KT_D: gl.constexpr = C.KT_D
    if C.M > 1:  # every token's logits: rows [M, V]
        if restage:
            mt.stage_normed(sm.hbuf, sm.wbuf, b.x16, b.emb, s.toks, False, b.fnorm, C.D, b.eps, KT_D, C)
        if C.TP > 1:  # the rank's vocabulary rows to every rank's gathering inbox (device/peer.py)
            return peer.matvec_rows_mt(sm, it, ins.field(W_K0), ins.field(W_K1), 0, ins.field(W_A), ins.field(W_NR),
                                       b, peer.LM_BOX, C)
        it = mt.part_rows(sm, it, ins.field(W_K0), ins.field(W_K1), 0, ins.field(W_A), ins.field(W_NR), b.logits,
                          C.V, C)
    else:
        if restage:
            mv.stage_normed(sm.hbuf, b.x, s.emb_row, False, b.fnorm, C.D, b.eps, KT_D, C)
        if C.TP > 1:
            return peer.matvec_rows(sm, it, ins.field(W_K0), ins.field(W_K1), ins.field(W_A), ins.field(W_NR), b,
                                    peer.LM_BOX, C)
        row0 = ins.field(W_A)
        k0 = ins.field(W_K0)
        k1 = ins.field(W_K1)
        offs_r = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
        for r in range(ins.field(W_NR)):
            acc, it = mv.dot_tile(sm, it, k0, k1, C)
            gl.store(b.logits + row0 + r * C.TR + offs_r, acc)
    return it
