"""Own-routing check: an MoE backend's logits against the reference forced onto that backend's own routing.

The enumeration check (``mimw.bench.routes``) compares a backend with the reference over every near-tie routing of
the step, up to a cap; with many near-ties (a deep stack of random routers) the cap cuts it short and a failure
proves nothing. A backend that reports the experts each MoE layer of its step ran (``Peer.routing``) is judged
exactly instead, in one reference run that follows that routing (``ReferenceDecoder.forward``'s ``route``):

  1. faithful routing: at every MoE layer the backend's experts are the reference router's own top k or a near-tie
     of it within ``tie`` (``routes.tie_gap``), where that router's input already holds the backend's choices of the
     earlier layers (the reference run follows them), so a near-tie taken early is not held against later layers;
  2. the logits: ``check.compare_logits`` against that run's logits, the usual bound.

The first layer whose experts are further than ``tie`` from the router's top k fails the backend, named with its
gap; a routing that is not k distinct experts of the router (a count off, an id out of range) has gap inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..models.moe import Routing
from ..models.weights import ModelWeights
from .check import REL_TOL, CheckResult, compare_logits
from .inputs import DecodeInputs, reference_logits
from .routes import follow, tie_gap


@dataclass(frozen=True)
class OwnRouteCheck:
    """The verdict: ``check`` (its detail names the source of the routing), the MoE layers whose experts are a
    near-tie other than the reference router's own top k (an exact tie, gap 0, included), the first unfaithful layer
    (None: faithful) and each MoE layer's gap, in layer order."""

    check: CheckResult
    near_ties: int
    bad_layer: int | None
    gaps: tuple[float, ...]

    def to_json(self) -> dict:
        finite = [g for g in self.gaps if g != float("inf")]
        return {**self.check.to_json(), "routing_source": "own", "near_ties": self.near_ties,
                "unfaithful_layer": self.bad_layer, "route_gap": max(finite + [0.0]) if len(finite) == len(self.gaps)
                else float("inf")}


def forced_reference(weights: ModelWeights, inputs: DecodeInputs,
                     chosen: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[float], list[bool]]:
    """The reference's logits [V] (fp32, CPU) with MoE layer i (the i-th of ``spec.moe_layers``) on the experts
    ``chosen[i]`` ([T, k] or [k]), each layer's ``tie_gap`` of them against its router's own top k, and whether they
    are another set than that top k. A layer whose experts are no valid set (gap inf) runs its own top k (the verdict
    is a failure either way)."""
    spec = weights.spec
    by_layer = dict(zip(spec.moe_layers, chosen))
    gaps: list[float] = []
    differs: list[bool] = []

    def route(layer: int, r: Routing) -> Routing:
        ids = torch.as_tensor(by_layer[layer]).to(torch.int64).cpu()
        own = r.ids.cpu()
        differs.append(ids.numel() != own.numel() or any(
            sorted(a) != sorted(b) for a, b in zip(ids.reshape(own.shape).tolist(), own.tolist())))
        if ids.numel() != own.numel():
            gaps.append(float("inf"))
            return r
        ids = ids.reshape(own.shape)
        gaps.append(max(tie_gap(r.probs[t], own[t].tolist(), ids[t].tolist()) for t in range(own.shape[0])))
        return r if gaps[-1] == float("inf") else follow(r, ids, spec)

    logits = reference_logits(weights, inputs, route=route)
    return logits.float().cpu(), gaps, differs


def own_route_check(logits: torch.Tensor, weights: ModelWeights, inputs: DecodeInputs,
                    chosen: Sequence[torch.Tensor], tie: float, rel_tol: float = REL_TOL) -> OwnRouteCheck:
    """Judge a backend's step (module doc): its ``logits`` and ``chosen``, its experts of every MoE layer in order."""
    layers = weights.spec.moe_layers
    if len(chosen) != len(layers):
        c = compare_logits(logits, reference_logits(weights, inputs), rel_tol)
        bad = CheckResult(False, c.rel_err, c.argmax, c.ref_argmax,
                          f"routing names {len(chosen)} MoE layers, the model has {len(layers)}", rel_tol)
        return OwnRouteCheck(bad, 0, -1, ())
    ref, gaps, differs = forced_reference(weights, inputs, chosen)
    c = compare_logits(logits, ref, rel_tol)
    near = sum(d and g <= tie for g, d in zip(gaps, differs))
    ties = f"{near} near-tie" + ("" if near == 1 else "s")
    unfaithful = [(layer, g) for layer, g in zip(layers, gaps) if g > tie]
    if unfaithful:
        layer, g = unfaithful[0]
        detail = f"routing not faithful at layer {layer} (gap {g:.2g} > tie {tie:.2g})"
        return OwnRouteCheck(CheckResult(False, c.rel_err, c.argmax, c.ref_argmax, detail, rel_tol), near, layer,
                             tuple(gaps))
    if c.ok:
        detail = f"ok (own routing; {ties}" + ("; argmax near-tie)" if "near-tie" in c.detail else ")")
    else:
        detail = f"{c.detail} (own routing; {ties})"
    return OwnRouteCheck(CheckResult(c.ok, c.rel_err, c.argmax, c.ref_argmax, detail, rel_tol), near, None,
                         tuple(gaps))
