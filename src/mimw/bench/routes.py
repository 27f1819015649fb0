"""Routes: the routings a faithful implementation of one MoE decode step may take, each with the reference's logits.

Why a plain bound on the logits is the wrong check for an MoE step: a router picks each token's k most probable
experts, and on random router weights the k-th and (k+1)-th probabilities are often close. Rounding alone (bf16
against fp32, one summation order against another) then decides which of the two experts runs, and a swapped expert
moves the logits by its whole share (about 0.1 relative on the 30B-A3B shape): a correct backend fails a bound
set by rounding, and a bound wide enough for it would excuse a wrong one. So the check compares an MoE backend's
logits with the reference run over each routing the step may legitimately take and passes it when one of them
is within the usual bound (``check.compare_routes``).

The near-tie rule (the one the megakernel's GPU checks apply to the routing tables they read,
``mimw.megakernel.tools.check``): for a token whose probabilities are p, with p_k and p_k+1 its k-th and (k+1)-th
largest, a set of k experts other than its own top k is a near-tie of it when every expert the set adds has
p >= p_k - tie and every expert of the top k it drops has p <= p_k+1 + tie. ``tie`` is twice the largest
|p_bf16 - p_fp32| of the step's routers, the bf16 reference against the fp32 one run over the same routing (what
rounding alone does to a router's probabilities, ``route_tie``).

Enumeration (``step_routes``): the reference runs the step its own way; each MoE layer whose routing has near-tie
alternatives gives one child run per alternative, which follows its parent up to that layer, takes the alternative
there (``ReferenceDecoder.forward``'s ``route``) and routes its own way after it: the later layers' inputs then hold
another expert's share, so their near-ties are found afresh, in the child. Breadth first (routings with fewer
deviations first), at most ``limit`` runs. A chosen set's weights are the reference's probabilities of those experts,
renormalised over them as top k renormalises its own (``follow``).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.moe import Routing
from ..models.spec import ModelSpec
from ..models.weights import ModelWeights
from .inputs import DecodeInputs, reference_logits

MAX_ROUTES = 256  # reference runs a step's enumeration may take: n independent near-ties make 2^n routes (the
# 30B-A3B shape: one near-tie in two layers on the CPU, so a 12-layer step's ~6 make ~64); a GPU run of one is
# milliseconds, and their logits stay on the host

RouteFn = Callable[[int, Routing], Routing]


@dataclass(frozen=True)
class Deviation:
    """One MoE layer where a route takes a near-tie instead of the reference's own top k: the experts each token
    would have chosen and the ones it runs (ascending)."""

    layer: int
    own: tuple[tuple[int, ...], ...]
    chosen: tuple[tuple[int, ...], ...]

    def describe(self) -> str:
        own = set(itertools.chain(*self.own))
        chosen = set(itertools.chain(*self.chosen))
        return f"layer {self.layer} runs {sorted(chosen - own)} for {sorted(own - chosen)}"


@dataclass(frozen=True)
class Route:
    """A legitimate routing of the step: its deviations from the reference's own choices, in layer order (none: the
    reference's own routing), and the reference's logits [V] (fp32, on the CPU) over it."""

    deviations: tuple[Deviation, ...]
    logits: torch.Tensor

    def describe(self) -> str:
        return "; ".join(d.describe() for d in self.deviations) or "the reference's own routing"


def follow(r: Routing, ids: torch.Tensor, spec: ModelSpec) -> Routing:
    """The routing that runs experts ``ids`` [T, k] where the router's own is ``r``: their probabilities from
    ``r.probs``, renormalised over them where ``spec.norm_topk_prob`` (as ``models.moe.top_k``), in ``r``'s weight
    dtype."""
    ids = ids.to(r.probs.device)
    w = r.probs.gather(-1, ids)
    if spec.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return Routing(ids, w.to(r.weights.dtype), r.probs)


def along(routings: list[Routing], spec: ModelSpec) -> RouteFn:
    """A ``route`` function that runs every MoE layer on the experts of ``routings`` (one per MoE layer, in order)."""
    by_layer = dict(zip(spec.moe_layers, routings))
    return lambda layer, r: follow(r, by_layer[layer].ids, spec)


def choices(probs: torch.Tensor, own: list[int], tie: float, limit: int = MAX_ROUTES) -> list[tuple[int, ...]]:
    """One token's probabilities [E] and its own top k (the experts its router chose: among equal probabilities
    the router's pick, whichever it was) -> that set and its near-ties (module doc; at most ``limit`` sets in all),
    each ascending, its own first."""
    p = probs.float().cpu().tolist()
    k, top = len(own), sorted(own)
    rest = [e for e in range(len(p)) if e not in top]
    kth = min(p[e] for e in top)
    nxt = max((p[e] for e in rest), default=float("-inf"))
    keep = [e for e in top if p[e] > nxt + tie]
    pool = [e for e in top if p[e] <= nxt + tie] + [e for e in rest if p[e] >= kth - tie]
    own = tuple(top)
    combos = itertools.islice(itertools.combinations(pool, k - len(keep)), limit)
    sets = {tuple(sorted(keep + list(c))) for c in combos}
    return ([own] + sorted(sets - {own}))[:limit]


def tie_gap(probs: torch.Tensor, own: list[int], chosen: list[int]) -> float:
    """The smallest ``tie`` for which ``chosen`` is ``own`` or a near-tie of it (module doc) for one token whose
    probabilities are ``probs`` [E] and whose own top k is ``own``: 0 when the sets agree, inf when ``chosen`` is not
    k distinct experts of the router. ``chosen`` is within ``choices(probs, own, tie)`` exactly when this is <= tie."""
    p = probs.float().cpu().tolist()
    top, got = set(own), list(chosen)
    if len(set(got)) != len(got) or len(got) != len(top) or not all(0 <= e < len(p) for e in got):
        return float("inf")
    kth = min(p[e] for e in top)
    nxt = max((p[e] for e in range(len(p)) if e not in top), default=float("-inf"))
    need = [kth - p[e] for e in set(got) - top] + [p[e] - nxt for e in top - set(got)]
    return max(need + [0.0])


def step_choices(r: Routing, tie: float, limit: int) -> list[torch.Tensor]:
    """A layer's routing of T tokens -> at most ``limit`` expert sets [T, k] (int64): every combination of the tokens'
    ``choices``, the own routing first."""
    per_token = [choices(r.probs[t], ids, tie, limit) for t, ids in enumerate(r.ids.cpu().tolist())]
    combos = itertools.islice(itertools.product(*per_token), limit)
    return [torch.tensor(c, dtype=torch.int64) for c in combos]


def route_tie(bf16: list[Routing], fp32: list[Routing]) -> float:
    """Twice the largest router-probability difference of two runs of the same routing (module doc)."""
    return 2 * max([float((a.probs.float() - b.probs.float().to(a.probs.device)).abs().max())
                    for a, b in zip(bf16, fp32)] + [0.0])


def fallback_tie(routings: list[Routing], dtype: torch.dtype) -> float:
    """``route_tie`` where no fp32 run could measure it: twice one rounding step of ``dtype`` relative to the largest
    probability (bf16: 2^-7 of it; fp32: effectively exact routing)."""
    top = max([float(r.probs.max()) for r in routings] + [0.0])
    return 2 * torch.finfo(dtype).eps * top


Run = Callable[[dict[int, torch.Tensor]], tuple[torch.Tensor, list[tuple[int, Routing]]]]


def enumerate_routes(run: Run, tie: float, limit: int = MAX_ROUTES) -> tuple[list[Route], bool]:
    """Breadth-first enumeration (module doc). ``run(forced)``: the step's logits with the MoE layers in ``forced``
    ({layer: ids [T, k]}) on those experts and every other on its own, and each MoE layer's own routing, in layer
    order. Returns the routes (the reference's own first) and whether ``limit`` cut the enumeration short."""
    queue: deque = deque([((), {}, -1)])
    routes: list[Route] = []
    while queue and len(routes) < limit:
        deviations, forced, last = queue.popleft()
        logits, layers = run(forced)
        routes.append(Route(deviations, logits))
        for layer, r in layers:
            if layer <= last:
                continue
            own = tuple(tuple(sorted(row)) for row in r.ids.cpu().tolist())
            for ids in step_choices(r, tie, limit)[1:]:
                d = Deviation(layer, own, tuple(tuple(row) for row in ids.tolist()))
                queue.append((deviations + (d,), {**forced, layer: ids}, layer))
    return routes, bool(queue)


def step_routes(weights: ModelWeights, inputs: DecodeInputs, tie: float,
                limit: int = MAX_ROUTES) -> tuple[list[Route], bool]:
    """``enumerate_routes`` over the reference decoder's step of ``inputs`` (``reference_logits``)."""
    spec = weights.spec

    def run(forced: dict[int, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, Routing]]]:
        layers: list[tuple[int, Routing]] = []

        def route(layer: int, r: Routing) -> Routing:
            layers.append((layer, r))
            return follow(r, forced[layer], spec) if layer in forced else r

        logits = reference_logits(weights, inputs, route=route)
        return logits.float().cpu(), layers

    return enumerate_routes(run, tie, limit)
