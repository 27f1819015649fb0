"""ROUTER: rows [row0, row0 + nrows) of an MoE layer's router for every token; the finisher (the last part to draw
its ticket) routes the step's tokens.

solve (every part):
    h                 = RMSNorm(x) * mlp_norm                          [M, D]  (rounded as in common.py)
    router_logits[:, r] = h . W_router[r]^T                            r = the part's rows below E (the tile
                                                                       array pads the router to whole row tiles)
finish:
    w, ids  = top-k of softmax(router_logits[:, :E]) in fp32, renormalised where norm_topk_prob (models/moe.py)
    slots   = the distinct experts the M tokens chose, ascending: slot j holds the j-th, S = Program.moe_slots
              = min(E, M * k) slots (M = 1: exactly k); the slots past them hold NO_EXPERT
    routed[layer, j] = isa.route_entry(slots[j], epoch)                (the routing table the expert spans read)
    slot_w[j, m]     = token m's weight for expert slots[j], 0 if m did not choose it (rounded to the weight dtype)
Writes: router_logits[:, rows] (every part); routed[layer, :], slot_w (the finisher). Reads: all of x.
Tiles: the part's rows of the router matrix.
Each distinct expert gets one slot however many tokens chose it, so a multi-token step reads its weights once:
EXPERT_IN / EXPERT_DOWN run per slot for all M tokens, and a token that did not choose the slot's expert adds it
with weight 0.
Device: RMSNorm(x) staged as MLP_IN stages it (EXPERT_IN, next in the queue, reuses it), the part's row tiles
dotted and stored; the ticket drawn; the finisher softmaxes the E logits in fp32 (one value a lane), takes the top
k one by one (the highest probability, the lowest expert among equals), renormalises where norm_topk_prob, and
stores the chosen experts ascending into the slots with their weights rounded to bf16 (the weight dtype), then
signals: the loader's expert spans (device/ring.py) and EXPERT_IN's wait read what it stored. A multi-token step
(C.M > 1) routes every token at once ([MB, EP2]) and stores the union of their experts, each expert's slot its
rank in the union.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.moe import top_k
from ...models.spec import ModelSpec
from ..isa import NO_COUNTER, NO_EXPERT, Instruction, Op, TileSpan, Word, route_entry
from ..tiles import WeightTiles, router_rows
from ..device import layouts, matvec as mv, matvec_mt as mt
from ..device.context import NO_EXPERT as NO_EXPERT_K
from ..device.context import W_A, W_C, W_D, W_K0, W_K1, W_LAYER, W_NR
from ..device.sync import route_entry as device_route_entry
from ..device.sync import ticket_is_last
from .common import OpContext, matvec, rms_norm

OP = Op.ROUTER


@dataclass(frozen=True)
class Router(Instruction):
    OP: ClassVar[Op] = Op.ROUTER
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "row0": Word.A, "nrows": Word.B, "n_parts": Word.C,
                                         "ticket": Word.D}
    layer: int = 0
    row0: int = 0
    nrows: int = 0
    n_parts: int = 1  # parts (row blocks) of the layer's router; the last to draw the ticket routes
    ticket: int = NO_COUNTER

    @property
    def has_finisher(self) -> bool:
        return True

    @property
    def ticket_count(self) -> int:
        return self.n_parts


def span(spec: ModelSpec, wt: WeightTiles, layer: int, row0: int, nrows: int) -> TileSpan:
    return wt.span("router", spec.moe_layers.index(layer) * router_rows(spec, wt.tile_rows) + row0, nrows)


def solve(ctx: OpContext, ins: Router) -> None:
    lw, e = ctx.weights.layers[ins.layer], ctx.spec.num_experts
    rows = slice(ins.row0, min(ins.row0 + ins.nrows, e))  # rows past E are the tile array's zero padding
    h = rms_norm(ctx.scratch.x, lw.mlp_norm, ctx.spec.rms_norm_eps)  # [M, D]
    ctx.scratch.router_logits[:, rows] = matvec(h, lw.router[rows])


def slots(ids: torch.Tensor, w: torch.Tensor, n_slots: int) -> tuple[list[int], torch.Tensor]:
    """ids, w [M, k] -> (the distinct experts ascending, padded with NO_EXPERT to ``n_slots``; each slot's weight
    for each token [n_slots, M], 0 where the token did not choose the slot's expert)."""
    experts = sorted(set(ids.flatten().tolist()))
    if len(experts) > n_slots:
        raise ValueError(f"{len(experts)} distinct experts for {n_slots} routing slots")
    sw = torch.zeros(n_slots, ids.shape[0], dtype=torch.float32, device=w.device)
    for j, e in enumerate(experts):
        sw[j] = (w * (ids == e)).sum(-1)  # a token chooses an expert at most once
    return experts + [NO_EXPERT] * (n_slots - len(experts)), sw


def finish(ctx: OpContext, ins: Router) -> None:
    """The last part: route every token, fill the layer's routing table and the slots' weights."""
    spec, wdtype = ctx.spec, ctx.weights.layers[ins.layer].router.dtype
    w, ids = top_k(ctx.scratch.router_logits[:, : spec.num_experts], spec)
    experts, sw = slots(ids, w.to(wdtype).float(), ctx.program.moe_slots)
    epoch = ctx.state.epoch
    ctx.scratch.routed[ins.layer] = torch.tensor([route_entry(e, epoch) for e in experts], dtype=torch.int32)
    ctx.scratch.slot_w.copy_(sw)


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, restage, sig):
    """One ROUTER part on the GPU; returns (it, the counter it signals: ``sig`` for the finisher, -1 for a part that
    finishes nothing)."""
    layer = ins.field(W_LAYER)
    KT_D: gl.constexpr = C.KT_D
    row0 = ins.field(W_A)
    k0 = ins.field(W_K0)
    k1 = ins.field(W_K1)
    if C.M > 1:  # every token's logits (device/matvec_mt.py), staged from x16 as MLP_IN stages them
        if restage:
            mt.stage_normed(sm.hbuf, sm.wbuf, b.x16, b.emb, s.toks, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D,
                            C)
        it = mt.part_rows(sm, it, k0, k1, 0, row0, ins.field(W_NR), b.router_logits, C.EP, C)
    else:
        if restage:
            mv.stage_normed(sm.hbuf, b.x, s.emb_row, False, b.mnorm + layer * C.D, C.D, b.eps, KT_D, C)
        offs = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
        for t in range(ins.field(W_NR)):
            acc, it = mv.dot_tile(sm, it, k0, k1, C)
            gl.store(b.router_logits + row0 + t * C.TR + offs, acc)
    if ticket_is_last(s.cnt, ins.field(W_D), ins.field(W_C), s.epoch):
        if C.M > 1:
            _route_mt(C, b, layer, s.epoch)
        else:
            _route(C, b, layer, s.epoch)
    else:
        sig = -1
    return it, sig


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _top_k_rows(b, t, i, C: gl.constexpr):
    """Tokens ``t`` [RB, 1] of a multi-token step (experts ``i`` [1, EP2]): (chosen [RB, EP2], each chosen expert's
    weight rounded to bf16, 0 elsewhere): softmax, the top k one at a time (the highest probability, the lowest
    expert among equals), renormalised where norm_topk_prob."""
    valid = (i < C.E) & (t < C.M)
    lg = gl.load(b.router_logits + t * C.EP + i, mask=valid, other=float("-inf"), cache_modifier=".cg")
    e = gl.exp(lg - gl.expand_dims(gl.max(lg, axis=1), 1))
    p = gl.where(valid, e / gl.expand_dims(gl.sum(gl.where(valid, e, 0.0), axis=1), 1), 0.0)
    chosen = (i + t * 0) < 0
    total = gl.sum(p * 0.0, axis=1)
    for _ in range(C.K):
        best = gl.max(gl.where(chosen | (~valid), -1.0, p), axis=1)
        pick = gl.min(gl.where((~chosen) & valid & (p == gl.expand_dims(best, 1)), i, C.EP2), axis=1)
        chosen = chosen | (i == gl.expand_dims(pick, 1))
        total = total + best
    w = p
    if C.NORM_TOPK:
        w = p / gl.expand_dims(total, 1)
    return chosen, gl.where(chosen, w, 0.0).to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _route_mt(C: gl.constexpr, b, layer, epoch):
    """The finisher of a multi-token step (``finish``), eight tokens at a time ([8, EP2], one token a row): the union
    of the tokens' chosen experts, ascending into the first slots (an expert's slot: how many chosen experts precede
    it), then each token's weight for each slot (0 where it did not choose the slot's expert; the top k recomputed,
    so that only eight tokens' state is live at once), and the slots past the union marked unused."""
    RB: gl.constexpr = 8
    RL: gl.constexpr = layouts.token_experts(C)
    r = gl.expand_dims(gl.arange(0, RB, gl.SliceLayout(1, RL)), 1)  # [RB, 1]
    i = gl.expand_dims(gl.arange(0, C.EP2, gl.SliceLayout(0, RL)), 0)  # [1, EP2]
    used = gl.max(((i + r * 0) < 0).to(gl.int32), axis=0)  # [EP2]: chosen by some token
    for c in range(0, C.MB, RB):
        chosen, w = _top_k_rows(b, c + r, i, C)
        used = gl.maximum(used, gl.max(chosen.to(gl.int32), axis=0))
    EL: gl.constexpr = layouts.experts(C)  # the scan runs on a plain one-dimensional layout
    used1 = gl.convert_layout(used, EL)
    rank1 = gl.associative_scan(used1, 0, _add) - used1  # the expert's slot: chosen experts below it
    n_used = gl.sum(used1, axis=0)
    e1 = gl.arange(0, C.EP2, EL)
    gl.store(b.routed + layer * C.S + rank1, device_route_entry(e1, epoch), mask=used1 > 0)
    j = gl.arange(0, C.S2, EL)
    gl.store(b.routed + layer * C.S + j, device_route_entry(j * 0 + NO_EXPERT_K, epoch), mask=(j >= n_used) & (j < C.S))
    rank = gl.expand_dims(gl.convert_layout(rank1, gl.SliceLayout(0, RL)), 0)
    for c in range(0, C.MB, RB):
        t = c + r
        chosen, w = _top_k_rows(b, t, i, C)
        gl.store(b.slot_w + rank * C.M + t, w, mask=(gl.expand_dims(used, 0) > 0) & (t < C.M))


@gluon.jit
def _route(C: gl.constexpr, b, layer, epoch):
    """The finisher (one token): softmax, top-k, renormalisation, the slots ascending (``finish``)."""
    EL: gl.constexpr = layouts.experts(C)
    i = gl.arange(0, C.EP2, EL)
    valid = i < C.E
    lg = gl.load(b.router_logits + i, mask=valid, other=float("-inf"), cache_modifier=".cg")
    p = gl.where(valid, gl.exp(lg - gl.max(lg, axis=0)), 0.0)
    p = p / gl.sum(p, axis=0)
    # top k, most probable first (the lowest expert among equals); their sum in that order
    chosen = i < 0
    total = 0.0
    for _ in range(C.K):
        best = gl.max(gl.where(chosen | (~valid), -1.0, p), axis=0)
        pick = gl.min(gl.where((~chosen) & valid & (p == best), i, C.EP2), axis=0)
        chosen = chosen | (i == pick)
        total = total + best
    # the slots: the chosen experts ascending, each with its weight rounded to bf16 (the weight dtype)
    taken = i < 0
    for j in range(C.K):
        e = gl.min(gl.where(chosen & (~taken), i, C.EP2), axis=0)
        taken = taken | (i == e)
        w = gl.sum(gl.where(i == e, p, 0.0), axis=0)
        if C.NORM_TOPK:
            w = w / total
        gl.store(b.slot_w + j, w.to(gl.bfloat16).to(gl.float32))
        gl.store(b.routed + layer * C.S + j, device_route_entry(e, epoch))
