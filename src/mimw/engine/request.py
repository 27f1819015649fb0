"""A generation request and its lifecycle: WAITING -> [LOADING ->] RUNNING -> (preempted -> WAITING ->) ... -> FINISHED.

``token_ids`` is the prompt followed by every sampled token. The K/V of positions [0, num_computed) are in the
pages of ``block_table`` (the ``mimw.kv.pages`` layout: position p lives in ``block_table[p // page_size]``).
Positions [num_computed, len(token_ids)) still have to be run through the model: the whole prompt right after
admission (prefill, possibly in chunks), exactly one token while decoding, or prompt + outputs again after a
preemption (the request lost its pages and recomputes them, mostly from the prefix cache). LOADING: admitted with
prefix pages that are still being copied back from the host tier; it runs once they have arrived.

With the overlapped engine (``engine/overlap.py``), a token sampled on the device is counted in ``num_tokens``
(``num_inflight``) one step before the host appends it to ``token_ids``: the scheduler plans with it, the engine
feeds it to the next step from the device.

Invariants:
  * len(block_table) == pages_for(num_computed) between steps (pages are allocated when a chunk is scheduled).
  * num_computed < num_tokens while RUNNING or WAITING: there is always a next token to sample from.
  * FINISHED requests hold no pages.
  * A request that asks for prompt logprobs computes its whole prompt (no prefix reuse) until every prompt
    token's logprob is collected (``needs_prompt_logits``); afterwards it behaves like any other.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .logprobs import TokenLogprob
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTimes:
    """Monotonic timestamps of one request (seconds): arrival, first scheduled, first token, finished."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float


@dataclass(frozen=True)
class RequestOutput:
    """One event for the client of a request: new text/tokens since the last event, and whether it ended.

    finish_reason: None while running; "stop" (EOS, stop token or stop string), "length" (max_tokens or the
    context limit), "abort" (cancelled, e.g. the client went away) or "error" (the backend failed; ``error``
    says why).
    logprobs: with ``params.logprobs``, one entry per token of ``token_ids`` that produced text (a stop token
    has none). prompt_logprobs: with ``params.prompt_logprobs``, on the first event only: one entry per prompt
    token, None for the first. times: on the final event only."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    times: RequestTimes | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # params.stop_token_ids plus the model's EOS ids (resolved)
    on_output: Callable[[RequestOutput], None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    session_id: str | None = None  # requests of one conversation/agent loop (drafters may share history)

    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)  # len(prompt_token_ids), which never changes
    status: Status = field(init=False, default=Status.WAITING)
    num_computed: int = field(init=False, default=0)
    block_table: list[int] = field(init=False, default_factory=list)
    page_hashes: list[bytes] = field(init=False, default_factory=list)  # chain hashes of full token pages
    num_registered: int = field(init=False, default=0)  # leading pages of block_table offered to the prefix cache
    num_cached_tokens: int = field(init=False, default=0)  # prompt tokens found in the prefix cache at admission
    num_host_cached_tokens: int = field(init=False, default=0)  # of which were restored from the host tier
    num_preemptions: int = field(init=False, default=0)
    admitted_once: bool = field(init=False, default=False)
    finish_reason: str | None = field(init=False, default=None)
    generator: torch.Generator | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    scheduled_time: float | None = field(init=False, default=None)  # first admission to a batch
    matcher: Any = field(init=False, default=None)  # grammar.GrammarMatcher of params.grammar, if any
    prompt_logprobs: list[TokenLogprob] = field(init=False, default_factory=list)  # of prompt tokens 1, 2, ...
    prompt_logprobs_sent: bool = field(init=False, default=False)
    num_inflight: int = field(init=False, default=0)  # sampled on the device, not read yet (engine/overlap.py)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Positions of the sequence: the known tokens and the one still in flight on the device, if any."""
        return len(self.token_ids) + self.num_inflight

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def last_in_flight(self) -> bool:
        """Its token in flight is its last (max_tokens, which the engine caps at the context): nothing to run."""
        return self.num_inflight > 0 and self.num_output_tokens + self.num_inflight >= self.params.max_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and some are still missing."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
