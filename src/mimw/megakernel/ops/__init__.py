"""The op table: one module per megakernel instruction, each holding everything about it in one place.

A module ``ops/<name>.py`` defines ``OP`` (its isa.Op), its instruction dataclass, ``span`` (the weight tiles it
streams, for the words the loader and compute read, the cost model and the host's hold marks; absent where it
streams none), its PyTorch reference ``solve`` (and ``finish`` where parts of a result are joined: the last part
to draw a ticket, or part 0 of a cluster pair), and the Gluon device code the kernel dispatches to
(``device/kernel.py``). Adding an instruction means adding one module and one row below (and its dispatch line).

``GPU_OPS`` are the instructions with device code, the ones the kernel dispatches (every instruction; the MoE ones,
ROUTER, EXPERT_IN and EXPERT_DOWN, for one token or a decode batch of up to eight: plan.MAX_MOE_BATCH; REDUCE, the
tensor-parallel reduction, in a tensor-parallel kernel only).

``SOLVERS[op](ctx, ins)`` runs one decoded instruction on the CPU (or any torch device) against the buffers of
``ctx``; the VM (``megakernel/vm.py``) calls it, and the GPU kernel is diffed against it.
"""
from __future__ import annotations

from typing import Callable

from ..isa import Instruction, Nop, Op
from . import attn_in, attn_partial, down_proj, expert_down, expert_in, lm_head, mlp_in, o_proj, reduce, router
from .common import OpContext

MODULES = (attn_in, attn_partial, o_proj, mlp_in, down_proj, lm_head, router, expert_in, expert_down, reduce)
OPS = {m.OP: m for m in MODULES}
GPU_OPS = {op: m for op, m in OPS.items() if hasattr(m, "compute")}

CLASSES: dict[Op, type[Instruction]] = {Op.NOP: Nop, Op.ATTN_IN: attn_in.AttnIn,
                                        Op.ATTN_PARTIAL: attn_partial.AttnPartial, Op.O_PROJ: o_proj.OProj,
                                        Op.MLP_IN: mlp_in.MlpIn, Op.DOWN_PROJ: down_proj.DownProj,
                                        Op.LM_HEAD: lm_head.LmHead, Op.ROUTER: router.Router,
                                        Op.EXPERT_IN: expert_in.ExpertIn, Op.EXPERT_DOWN: expert_down.ExpertDown,
                                        Op.REDUCE: reduce.Reduce}


def _nop(ctx: OpContext, ins: Instruction) -> None:
    pass


SOLVERS: dict[Op, Callable[[OpContext, Instruction], None]] = {Op.NOP: _nop, **{op: m.solve for op, m in OPS.items()}}
FINISHERS: dict[Op, Callable[[OpContext, Instruction], None]] = {
    Op.ATTN_IN: attn_in.finish, Op.ATTN_PARTIAL: attn_partial.finish, Op.DOWN_PROJ: down_proj.finish,
    Op.ROUTER: router.finish, Op.EXPERT_DOWN: expert_down.finish}

__all__ = ["OpContext", "OPS", "GPU_OPS", "CLASSES", "SOLVERS", "FINISHERS", "MODULES"]
