"""The mixture-of-experts MLP of Qwen3-MoE, as transformers computes it: the reference for every MoE backend.

For each token's normalised hidden state h [D] (T tokens at once):

    logits  = h . router^T                                   [T, E]   in the activation dtype
    p       = softmax(logits) in fp32                        [T, E]
    w, ids  = top-k of p (k = num_experts_per_tok)           [T, k]   ids in descending probability
    w       = w / sum(w)   where norm_topk_prob               (renormalised over the chosen experts)
    w       = w in the activation dtype
    out[t]  = sum over the chosen experts e, in ascending expert order, of
              w[t, e] * (silu(h . gate_e^T) * (h . up_e^T)) . down_e^T

``experts_once`` is the grouping every multi-token backend uses: each expert any token chose runs once, on the rows
of the tokens that chose it (transformers' ``Qwen3MoeExperts`` loop; a step's distinct experts are what it must
read from memory, ``mimw.bench.floor``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .spec import ModelSpec
from .weights import LayerWeights


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of T tokens: ``ids`` [T, k] (int64, descending probability), ``weights`` [T, k], and
    (from ``route``) every expert's probability ``probs`` [T, E] fp32, what a check needs to tell near-ties."""

    ids: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def experts(self) -> list[int]:
        """The distinct experts the tokens chose, ascending: the ones a step must read."""
        return sorted(set(self.ids.flatten().tolist()))


def top_k(logits: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): softmax in fp32, the k most probable,
    renormalised over them where ``spec.norm_topk_prob``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, spec.num_experts_per_tok, dim=-1)
    if spec.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def route(h: torch.Tensor, router: torch.Tensor, spec: ModelSpec) -> Routing:
    """h [T, D] (the MLP input, after the post-attention norm), router [E, D] -> the top-k routing."""
    logits = F.linear(h, router)  # [T, E]
    w, ids = top_k(logits, spec)
    return Routing(ids, w.to(logits.dtype), torch.softmax(logits, dim=-1, dtype=torch.float32))


def expert_mlp(h: torch.Tensor, lw: LayerWeights, e: int) -> torch.Tensor:
    """Expert ``e``'s SwiGLU on rows h [n, D] -> [n, D]."""
    return F.linear(F.silu(F.linear(h, lw.e_gate[e])) * F.linear(h, lw.e_up[e]), lw.e_down[e])


def experts_once(h: torch.Tensor, lw: LayerWeights, r: Routing) -> torch.Tensor:
    """The weighted sum of each token's chosen experts, each distinct expert run once on its tokens: [T, D]."""
    out = torch.zeros_like(h)
    for e in r.experts:
        tok, slot = torch.where(r.ids == e)
        y = expert_mlp(h[tok], lw, e) * r.weights[tok, slot, None]
        out[tok] += y.to(out.dtype)  # a token chooses an expert once: no index repeats
    return out


def moe_mlp(h: torch.Tensor, lw: LayerWeights, spec: ModelSpec, routings: list[Routing] | None = None,
            choose: Callable[[Routing], Routing] | None = None) -> torch.Tensor:
    """The MoE block's output for h [T, D] (to be added to the residual); appends the routing to ``routings``
    when given (what a caller wants to know of the step, e.g. the bytes it must read). ``choose``: given the
    router's own routing, the routing the block runs instead (a check following another implementation's choice
    at a near-tie, ``mimw.bench.routes``); what it returns is what ``routings`` receives."""
    r = route(h, lw.router, spec)
    if choose is not None:
        r = choose(r)
    if routings is not None:
        routings.append(r)
    return experts_once(h, lw, r)
