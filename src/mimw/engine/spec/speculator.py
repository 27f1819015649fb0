"""Speculator: the engine's speculative-decoding step parts - drafts for a planned step, verification, counters.

Per step (``Engine.step`` calls these in order):
  1. ``propose(plan, scheduler, max_model_len)``: for the chunks that sample a token this step, ask the policy for
     a draft length (0 for requests speculation does not apply to, see ``verify.speculation_applies``), cut the
     lengths to the room left before max_tokens / the context end and to the batch threshold, ask the drafter,
     and have the scheduler add pages for the drafted positions (never preempting; a draft shrinks to the pages
     it gets). Returns the drafts by request.
  2. The engine runs each drafted chunk as one segment [chunk tokens, d_1 .. d_k] with 1 + k logits rows.
  3. ``verify(request, logits, draft)``: the tokens to emit (``verify.verify``), and the counters.
  4. The engine appends them (stop checks token by token) and, if the request goes on, ``Scheduler.advance``
     makes the accepted drafts computed and releases the pages of the rejected ones.
  5. ``finish(request)`` when a request ends, for the drafter's per-request and session state.

A drafter that raises costs its drafts for that step, never a request: the step runs without drafts.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..request import Request
from ..scheduler import Scheduler, StepPlan
from ..step_costs import StepCosts
from .config import SpecConfig
from .drafter import Draft, DraftInput, Drafter
from .policy import DraftLengthPolicy
from .verify import speculation_applies, verify

log = logging.getLogger("mimw.spec")


@dataclass(frozen=True)
class SpecStats:
    """Cumulative counters. ``accepted_hist[a]``: verify steps that accepted a drafted tokens (a = 0 .. K);
    ``blocks[(k, a)]``: verify steps that drafted k tokens and accepted a of them."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_hist: tuple[int, ...] = ()
    drafter_errors: int = 0
    blocks: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def mean_emitted(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Speculator:
    def __init__(self, drafter: Drafter, config: SpecConfig):
        self.drafter = drafter
        self.cfg = config
        self.policy = DraftLengthPolicy(config)
        self.costs: StepCosts | None = None  # the target backend's measured step times (the engine binds them)
        self._draft_tokens = 0
        self._accepted_tokens = 0
        self._hist = [0] * (config.num_tokens + 1)
        self._errors = 0
        self._blocks: Counter[tuple[int, int]] = Counter()

    def stats(self) -> SpecStats:
        return SpecStats(self._draft_tokens, self._accepted_tokens, sum(self._hist), tuple(self._hist),
                         self._errors, dict(self._blocks))

    # --- 1. drafts for a planned step ----------------------------------------------------------------------
    def propose(self, plan: StepPlan, scheduler: Scheduler, max_model_len: int) -> dict[Request, Draft]:
        sampling = [c for c in plan.chunks if c.samples]
        budget = min(self.cfg.max_verify_tokens - len(sampling), scheduler.cfg.max_step_tokens - plan.num_tokens)
        if budget <= 0:
            return {}
        wants: list[tuple[float, Request, int]] = []
        costs, base = self.costs, plan.num_tokens
        cost = (lambda k: costs.relative(base, k)) if costs is not None else None
        for c in sampling:
            r = c.request
            if not speculation_applies(r.params):
                continue
            room = min(r.params.max_tokens - r.num_output_tokens, max_model_len - r.num_tokens) - 1
            k = min(self.policy.length(r.request_id, cost), room)
            if k > 0:
                wants.append((self.policy.alpha(r.request_id), r, k))
        wants.sort(key=lambda w: -w[0])  # the batch threshold cuts the least promising requests first
        reqs, ks = [], []
        for _, r, k in wants:
            k = min(k, budget)
            if k <= 0:
                break
            reqs.append(r)
            ks.append(k)
            budget -= k
        if not reqs:
            return {}
        try:
            drafts = self.drafter.propose([_input(r) for r in reqs], ks)
        except Exception:  # a broken drafter slows requests down, never fails them
            self._errors += 1
            log.exception("drafter failed; this step runs without drafts")
            return {}
        out: dict[Request, Draft] = {}
        for r, k, d in zip(reqs, ks, drafts):
            d = d.truncated(k)
            if len(d) == 0:
                continue
            d = d.truncated(scheduler.extend(r, len(d)))
            if len(d):
                out[r] = d
        return out

    # --- 3. verification ----------------------------------------------------------------------------------------
    def verify(self, r: Request, logits: torch.Tensor, draft: Draft) -> list[int]:
        """logits [1 + len(draft), V] of r's block -> the tokens r emits (1 .. len(draft) + 1)."""
        tokens = verify(logits, draft, r.params, r.generator)
        accepted = len(tokens) - 1
        self._draft_tokens += len(draft)
        self._accepted_tokens += accepted
        self._hist[min(accepted, len(self._hist) - 1)] += 1
        self._blocks[(len(draft), accepted)] += 1
        self.policy.update(r.request_id, len(draft), accepted)
        self.drafter.observe(r.request_id, len(draft), accepted)
        return tokens

    # --- 5. the end of a request --------------------------------------------------------------------------------
    def finish(self, r: Request) -> None:
        self.policy.forget(r.request_id)
        try:
            self.drafter.finish(_input(r))
        except Exception:
            self._errors += 1
            log.exception("drafter failed to release request %s", r.request_id)


def _input(r: Request) -> DraftInput:
    return DraftInput(r.request_id, r.token_ids, r.num_prompt_tokens, r.params, r.session_id)


def make_drafter(config: SpecConfig, draft_backend=None, page_size: int = 16,
                 default_pages: int = 256) -> Drafter:
    """The drafter ``config.method`` names; ``draft_backend`` (a ``Backend`` over the draft model) for "draft"."""
    if config.method == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter(config.ngram_min, config.ngram_max)
    if config.method == "suffix":
        from .suffix import SuffixDrafter
        return SuffixDrafter(config.suffix)
    if draft_backend is None:
        raise ValueError("--speculative draft needs the draft model's backend")
    from .draft_model import DraftModelDrafter
    return DraftModelDrafter(draft_backend, config.draft_pages or default_pages, page_size, config.sample_drafts)

