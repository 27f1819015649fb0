"""Draft length per request: from how much of its drafts the target accepts, and what a verify step costs.

Model: each drafted token is accepted with probability alpha, independently, until the first rejection. A step
that drafts k tokens then emits E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens and
costs c(k) = v(k) + delta k decode steps (c(0) = 1: a plain decode; delta: the drafter's cost per token, see
``SpecConfig``), where v(k), the step with k more tokens against the step without them, is what the engine measured
(``StepCosts.relative``) or, for sizes not measured yet, the configured 1 + beta + gamma k. The policy drafts the k
in [0, K] with the most tokens per unit of cost, E(k) / c(k); k = 0 (no drafting) wins where acceptance is too low
to pay for verification.

alpha is estimated per request from its verified drafts, recent steps weighing more: with a accepted of k drafted,
the step saw a acceptances and, if a < k, one rejection; alpha = (A + 1) / (A + R + 2) over decayed sums A, R
(a uniform prior: a new request starts at 1/2). A request whose best k is 0 drafts one token every
``probe_interval`` steps so that its estimate can recover, unless no acceptance could pay for drafting at the
measured costs (not even alpha = 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import SpecConfig

Cost = Callable[[int], "float | None"]  # k -> measured v(k), or None where not measured

_DECAY = 0.8  # weight of a request's history per new verification


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    idle_steps: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)


class DraftLengthPolicy:
    def __init__(self, config: SpecConfig):
        self.cfg = config
        self._reqs: dict[str, _Acceptance] = {}

    def alpha(self, request_id: str) -> float:
        return self._reqs.get(request_id, _Acceptance()).alpha

    def best_length(self, alpha: float, cost: Cost | None = None) -> int:
        """argmax over k in [0, K] of E(k) / c(k) (the smallest such k on ties)."""
        cfg = self.cfg
        best_k, best_rate = 0, 1.0
        expected, term = 1.0, 1.0
        for k in range(1, cfg.num_tokens + 1):
            term *= alpha
            expected += term
            measured = cost(k) if cost is not None else None
            verify = measured if measured is not None else 1.0 + cfg.verify_overhead + cfg.verify_token_cost * k
            rate = expected / (verify + cfg.drafter_token_cost * k)
            if rate > best_rate + 1e-12:
                best_k, best_rate = k, rate
        return best_k

    def length(self, request_id: str, cost: Cost | None = None) -> int:
        """Tokens to ask the drafter for this step (0: decode plainly); ``cost``: the measured v(k) of this step."""
        st = self._reqs.setdefault(request_id, _Acceptance())
        k = self.best_length(st.alpha, cost)
        if k > 0:
            st.idle_steps = 0
            return k
        if self.best_length(1.0, cost) == 0:  # not even perfect acceptance would pay: no probe
            return 0
        st.idle_steps += 1
        if st.idle_steps >= self.cfg.probe_interval:
            st.idle_steps = 0
            return 1
        return 0

    def update(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        st = self._reqs.setdefault(request_id, _Acceptance())
        st.accepted = _DECAY * st.accepted + num_accepted
        st.rejected = _DECAY * st.rejected + (1.0 if num_accepted < num_drafted else 0.0)

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
