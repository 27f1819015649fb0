"""REDUCE: rows [row0, row0 + nrows) of a tensor-parallel reduction, from this rank's inbox (megakernel/peers.py).

Every rank of N runs the same REDUCE instructions on its own inbox, which holds every rank's partial of the rows in
slot [src]; it waits for the rows' peer counter to reach N signals a step (one from each rank's partial).
    O_SUM:     x[:, rows] = x_in[:, rows] + (inbox[0] + inbox[1] + ... + inbox[N-1])[:, rows]
               x_in: scratch.x as the previous layer left it, or the embedding rows (layer 0), as O_PROJ reads it
    DOWN_SUM:  x[:, rows] = x[:, rows] + (inbox[0] + ... + inbox[N-1])[:, rows]
    LM_GATHER: logits[:, src * V/N + rows] = inbox[src][:, rows]  for every src   (``rows``: of a rank's V/N)
The partials are summed in rank order whichever rank runs the sum, so every rank's x is bit-identical, and so are
the logits, copied unchanged. Writes: x[:, rows] (sums) or those logits columns (gather). Reads: the inbox's rows
of every slot; x[:, rows] or the embedding rows (sums). Tiles: none.
Device: row tile by row tile, every slot's rows requested together (through L2, where the peers' stores land:
device/peer.py), summed in slot order; a multi-token step also writes x's bf16 copy x16, as O_PROJ and DOWN_PROJ do
on one GPU. The kernel waits for the peer counter at system scope before it runs (device/kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..device import peer
from ..device.context import W_A, W_B, W_C, W_LAYER
from ..isa import Op, RowBlock, Word
from ..peers import LM_GATHER, O_SUM
from .common import OpContext, residual

OP = Op.REDUCE


@dataclass(frozen=True)
class Reduce(RowBlock):
    OP: ClassVar[Op] = Op.REDUCE
    FIELDS: ClassVar[dict[str, Word]] = {**RowBlock.FIELDS, "kind": Word.C, "n_ranks": Word.D}
    kind: int = O_SUM  # which inbox: peers.O_SUM, DOWN_SUM or LM_GATHER
    n_ranks: int = 1


def solve(ctx: OpContext, ins: Reduce) -> None:
    if ctx.peers is None:
        raise RuntimeError(f"{ins} runs only in a tensor-parallel step (its context has no peer memory)")
    rows = slice(ins.row0, ins.row0 + ins.nrows)
    box = ctx.peers.inbox(ins.kind)  # [N, M, width]
    if ins.kind == LM_GATHER:
        vn = box.shape[-1]
        for src in range(ins.n_ranks):
            ctx.scratch.logits[:, src * vn + ins.row0: src * vn + ins.row0 + ins.nrows] = box[src, :, rows]
        return
    total = box[0, :, rows]
    for src in range(1, ins.n_ranks):
        total = total + box[src, :, rows]
    base = residual(ctx, ins.layer, rows) if ins.kind == O_SUM else ctx.scratch.x[:, rows]
    ctx.scratch.x[:, rows] = base + total


@gluon.jit
def compute(ins, C: gl.constexpr, s, b):
    """One REDUCE block on the GPU (C.TP ranks), after its peer counter's wait."""
    _rows(ins.field(W_A), ins.field(W_B), ins.field(W_C), ins.field(W_LAYER), b.pbox, gl.load(b.prank), b.x, b.x16,
          b.emb, s.toks, b.logits, C)


@gluon.jit(noinline=True)
def _rows(row0, nrows, kind, layer, pbox, rank, x, x16, emb, toks, logits, C: gl.constexpr):
    """``compute``'s work, a function of its own: its registers are allocated apart from the kernel's loop, which a
    multi-token kernel keeps at the register limit (the 8B's at 16 tokens spilled with it inlined). No barriers
    (device/sync.py: a noinline function's would be CTA-wide)."""
    L: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, C.NW], [0, 1])  # [TR rows, MB tokens]
    offs = gl.expand_dims(gl.arange(0, C.TR, gl.SliceLayout(1, L)), 1)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, L)), 0)
    TP: gl.constexpr = C.TP
    box = gl.load(pbox + rank).to(gl.pointer_type(gl.float32), bitcast=True)  # this rank's inboxes
    if kind == peer.LM_BOX:  # every rank's logits of its vocabulary rows, to their columns of the whole vocabulary
        LM: gl.constexpr = peer.box_offset(peer.LM_BOX, C)
        for r in range(nrows // C.TR):
            rows = row0 + r * C.TR + offs
            ok = (t < C.M) & (rows >= 0)
            for src in gl.static_range(TP):
                v = gl.load(box + LM + (src * C.M + t) * C.V + rows, mask=ok, other=0.0, cache_modifier=".cg")
                gl.store(logits + t * (C.V * TP) + src * C.V + rows, v, mask=ok)
    else:
        off = kind * (TP * C.M * C.D)
        from_embed = (kind == peer.O_BOX) & (layer == 0)
        for r in range(nrows // C.TR):
            rows = row0 + r * C.TR + offs
            ok = (t < C.M) & (rows >= 0)
            o = t * C.D + rows
            if from_embed:  # layer 0's residual: the tokens' embedding rows
                tok = gl.load(toks + t, mask=t < C.M, other=0)
                res = gl.load(emb + tok.to(gl.int64) * C.D + rows, mask=ok, other=0.0).to(gl.float32)
            else:
                res = gl.load(x + o, mask=ok, other=0.0, cache_modifier=".cg")
            tot = gl.load(box + off + o, mask=ok, other=0.0, cache_modifier=".cg")
            for src in gl.static_range(1, TP):
                tot += gl.load(box + off + src * (C.M * C.D) + o, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(x + o, res + tot, mask=ok)
            if C.M > 1:
                gl.store(x16 + o, (res + tot).to(gl.bfloat16), mask=ok)
