"""Chunk policy: how many prompt tokens each prefilling request runs in the next step (pure functions; the
scheduler applies them).

Cost model. A step's duration is about its tokens' weight FLOPs plus their attention FLOPs. Per layer, a token
costs 2 x (matmul parameters) in the weights and 4 x head_dim x num_heads per key it attends to, so a token at
context c costs (1 + c / R) "tokens" with R = 2 x params / (4 x head_dim x num_heads) (``attention_cost_tokens``:
~14.8k for Llama-3.2-1B, ~26.6k for Llama-3.1-8B, ~3.1k for SmolLM2-135M). A chunk of n tokens from position s:
    cost(n, s) = n + n (s + (n + 1) / 2) / R.
When decoders share the step they wait for all of it, so the chunk is sized by cost, not tokens: as a long prompt's
context grows its chunks shrink and each step stays about ``max_step_tokens`` short-context tokens long, the
decoders' stall no larger than one such chunk's cost. A step without decoders sizes chunks by tokens (only
throughput matters; memory per pass is the prefill path's business).

Fairness. The prefill budget is shared by max-min fairness (water-filling): every prefilling request gets an equal
share, a request that needs less than its share takes what it needs and the rest is shared again, the remainder
units going to the oldest. A short prompt arriving behind a long one is done in its first step; several long ones
advance together; the oldest always gets at least one token.
"""
from __future__ import annotations

from typing import Sequence

from ..models.spec import ModelSpec


def attention_cost_tokens(spec: ModelSpec) -> int:
    """R: the context at which one token's attention FLOPs equal its weight FLOPs."""
    d, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    matmul_params = d * (q + 2 * kv) + q * d + 3 * d * i
    return max(1, round(2 * matmul_params / (4 * spec.head_dim * spec.num_heads)))


def chunk_cost(n: int, start: int, r: int) -> int:
    """cost(n, s) in tokens (r = R; 0: attention not counted, the cost is n)."""
    if r <= 0 or n <= 0:
        return max(0, n)
    return -(-(n * (2 * r + 2 * start + n + 1)) // (2 * r))  # ceil(n + n (s + (n + 1) / 2) / r)


def tokens_within(cost: int, start: int, pending: int, r: int) -> int:
    """The longest chunk (<= pending) from ``start`` whose cost is <= ``cost``; at least 1 when cost >= 1, so a
    request given any budget progresses."""
    if cost <= 0 or pending <= 0:
        return 0
    lo, hi = 1, min(pending, cost)  # cost(n) >= n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_cost(mid, start, r) <= cost:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fair_shares(budget: int, demands: Sequence[int]) -> list[int]:
    """Max-min fair integer shares of ``budget``: share[i] <= demands[i], sum <= budget, and no share can grow
    without shrinking a smaller one; leftover units (fewer than the open requests) go to the earliest."""
    shares = [0] * len(demands)
    left = budget
    open_ = [i for i, d in enumerate(demands) if d > 0]
    while open_ and left > 0:
        each = left // len(open_)
        if each == 0:
            for i in open_[:left]:
                shares[i] += 1
            break
        still = []
        for i in open_:
            give = min(each, demands[i] - shares[i])
            shares[i] += give
            left -= give
            if shares[i] < demands[i]:
                still.append(i)
        open_ = still
    return shares
