"""Reference solvers of the megakernel instructions, one module per instruction (see each module's docstring).

``SOLVERS[op](ctx, ins)`` runs one decoded instruction on the CPU (or any torch device) against the buffers of
``ctx``; the VM (``megakernel/vm.py``) calls it, and the GPU kernel is diffed against it. ``FINISHERS[op]`` is the
second half of a ticketed instruction (isa.py), run by the part that draws the last ticket.
"""
from __future__ import annotations

from typing import Callable

from ..isa import Instruction, Op
from . import attn_in, attn_partial, attn_reduce, down_proj, lm_head, mlp_in, o_proj
from .common import OpContext


def _nop(ctx: OpContext, ins: Instruction) -> None:
    pass


SOLVERS: dict[Op, Callable[[OpContext, Instruction], None]] = {
    Op.NOP: _nop,
    Op.ATTN_IN: attn_in.solve,
    Op.ATTN_PARTIAL: attn_partial.solve,
    Op.ATTN_REDUCE: attn_reduce.solve,
    Op.O_PROJ: o_proj.solve,
    Op.MLP_IN: mlp_in.solve,
    Op.DOWN_PROJ: down_proj.solve,
    Op.LM_HEAD: lm_head.solve,
}

FINISHERS: dict[Op, Callable[[OpContext, Instruction], None]] = {
    Op.ATTN_IN: attn_in.finish,
    Op.ATTN_PARTIAL: attn_reduce.solve,  # combining splits: the same fields (layer, kv_head, seg, n_splits)
    Op.DOWN_PROJ: down_proj.finish,  # part 0 of a cluster pair (ProgramConfig.cluster_down)
}

__all__ = ["OpContext", "SOLVERS", "FINISHERS"]
