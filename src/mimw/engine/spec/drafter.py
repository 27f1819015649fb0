"""Drafter: proposes up to k next tokens of a request from its tokens so far; the target model verifies them.

A drafter never decides what a request outputs: the verification rule (``verify``) keeps the output exactly that
of plain decoding, whatever is proposed. A bad drafter only costs speed.

Protocol (one engine thread calls it; drafters are not thread-safe):
  * ``propose(inputs, ks)`` -> one ``Draft`` per input, at most ``ks[i]`` tokens each (fewer or none when the
    drafter has nothing it trusts). ``inputs[i].token_ids`` is the request's prompt plus every token it has
    output so far; the draft continues it. Called once per step for the requests that sample in that step.
  * ``observe(request_id, num_drafted, num_accepted)`` after each verification of that request's draft.
  * ``finish(x)`` once when the request ends (any reason), with its final tokens: the drafter drops its
    per-request state and may keep the finished sequence as history for the request's session.
A request may be proposed for again after its tokens changed in ways other than appending (preemption keeps the
tokens, but a drafter must not assume it saw every step): drafters key their state on ``token_ids`` themselves.

``Draft.probs`` is the drafter's distribution q over the vocabulary at each drafted position ([k, V], fp32, on
the CPU) when it *sampled* its tokens; ``None`` means the tokens are a deterministic function of the context
(q is a point mass), which is what prompt lookup, suffix trees and argmax drafting give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..sampling import SamplingParams


@dataclass(frozen=True)
class DraftInput:
    """What a drafter sees of one request: its id, all its tokens (prompt + output), its session, its params."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    params: SamplingParams
    session_id: str | None = None


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None  # [len(tokens), V] q of sampled drafts; None: deterministic drafts

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(f"draft probs must be [{len(self.tokens)}, vocab], got {tuple(self.probs.shape)}")

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, k: int) -> "Draft":
        """The first ``k`` drafted tokens (and their q rows)."""
        if k >= len(self.tokens):
            return self
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k])


NO_DRAFT = Draft()


class Drafter(Protocol):
    def propose(self, inputs: Sequence[DraftInput], ks: Sequence[int]) -> list[Draft]:
        """One draft per input, at most ks[i] tokens each."""
        ...

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """The target verified ``num_drafted`` proposed tokens of this request and kept ``num_accepted``."""
        ...

    def finish(self, x: DraftInput) -> None:
        """The request ended; ``x.token_ids`` are its final tokens (prompt + output)."""
        ...


class TokenDrafter:
    """Base of the drafters that look at one request at a time and keep no per-request device state (n-gram,
    suffix): ``propose`` maps ``propose_one`` over the batch; ``observe``/``finish`` do nothing unless overridden."""

    def propose(self, inputs: Sequence[DraftInput], ks: Sequence[int]) -> list[Draft]:
        return [Draft(tuple(self.propose_one(x, k))) if k > 0 else NO_DRAFT for x, k in zip(inputs, ks)]

    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        raise NotImplementedError

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def finish(self, x: DraftInput) -> None:
        pass
