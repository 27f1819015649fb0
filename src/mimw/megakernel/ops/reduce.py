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
No device code: the GPU kernel refuses programs holding REDUCE (plan.py); docs/megakernel.md, "Tensor
parallelism", describes what it would do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
