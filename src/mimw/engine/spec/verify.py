"""Verification: which drafted tokens a request keeps, so that its output is distributed exactly as plain decoding's.

The target ran one segment over [pending token, d_1 .. d_k]; row j of its logits is the target's distribution p_j
for the token after d_j (row 0: after the pending token). Let x_j = d_{j+1} be the draft for that position.

Deterministic drafts (q_j a point mass on x_j; greedy requests always take this path):
    for j = 0 .. k:  y_j = sample(p_j) with the request's generator  (exactly the plain decoding call)
                     emit y_j; stop unless j < k and y_j == x_j
Greedy: the longest prefix of the draft that matches the target's argmax, then the target's next token.
Sampling: this is the speculative-sampling rule for q = point mass — x_j is accepted with probability
p_j(x_j) = min(1, p_j(x_j) / q_j(x_j)), and on rejection y_j ~ p_j restricted to tokens != x_j, which is
norm(max(0, p_j - q_j)). The generator advances once per emitted token, as in plain decoding, so a seeded
request emits the very tokens it would without speculation, whatever the draft lengths or batch.

Sampled drafts (``Draft.probs`` = q_j, from a draft model that sampled x_j ~ q_j), the standard rule
(Leviathan et al. 2023; Chen et al. 2023):
    accept x_j iff u < p_j(x_j) / q_j(x_j), u ~ U[0, 1)
    else emit y ~ norm(max(0, p_j - q_j)) and stop;   after k acceptances emit y ~ p_k.
P(emit t) = q(t) min(1, p(t)/q(t)) + (1 - sum_s min(p(s), q(s))) (p(t) - q(t))^+ / sum_s (p(s) - q(s))^+ = p(t).
Outputs are reproducible for a seed given the same draft lengths (the draws depend on where drafts stop).

``speculation_applies(params)`` says whether the per-token distribution of a request depends only on its logits:
a field of ``SamplingParams`` outside ``BLOCK_INDEPENDENT`` (a penalty over earlier tokens, a grammar, prompt
logprobs, ...) set to anything but its default turns speculation off for that request (it decodes plainly instead).
``sample`` and ``filtered_probs`` apply ``logit_bias`` and ``min_p`` from the params alone, and a sampled token's
logprobs come from its own row of the block, so those speculate.
"""
from __future__ import annotations

import dataclasses

import torch

from ..sampling import SamplingParams, filtered_probs, sample
from .drafter import Draft

# Fields whose effect on token t does not depend on the tokens drafted before t.
BLOCK_INDEPENDENT = frozenset({"temperature", "top_p", "top_k", "min_p", "logit_bias", "logprobs", "seed",
                               "max_tokens", "stop", "stop_token_ids", "ignore_eos"})


def speculation_applies(params: SamplingParams) -> bool:
    """True when every field of ``params`` outside ``BLOCK_INDEPENDENT`` has its default value."""
    for f in dataclasses.fields(params):
        if f.name in BLOCK_INDEPENDENT:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # a required field we know nothing about
            return False
        if getattr(params, f.name) != default:
            return False
    return True


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [1 + len(draft), V] -> the tokens to emit: the accepted draft prefix plus one target token."""
    k = len(draft)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify: expected logits [{k + 1}, vocab], got {tuple(logits.shape)}")
    if params.greedy:
        ys = torch.argmax(logits, dim=-1).tolist()  # one host sync for the block
        return _match(ys, draft.tokens)
    if draft.probs is None:
        out = []
        for j in range(k + 1):
            y = sample(logits[j], params, generator)
            out.append(y)
            if j == k or y != draft.tokens[j]:
                return out
    out = []
    for j, x in enumerate(draft.tokens):
        p = filtered_probs(logits[j], params)
        q = draft.probs[j]
        u = float(torch.rand((), generator=generator))
        if u * float(q[x]) < float(p[x]):
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:  # q == p up to rounding: rejection has probability ~0
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(sample(logits[k], params, generator))
    return out


def _match(targets: list[int], draft: tuple[int, ...]) -> list[int]:
    """The target tokens up to and including the first that differs from the draft (all k+1 if none does)."""
    for j, x in enumerate(draft):
        if targets[j] != x:
            return targets[:j + 1]
    return targets[:len(draft) + 1]
