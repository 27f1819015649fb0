"""Overlap: the tokens of one step stay on the device while the host prepares and launches the next step.

The engine (``Engine.step``) samples the requests of a step on the device (``sampling.sample_ids``) into a token
tensor, starts a non-blocking copy of it to pinned host memory and records an event: an ``InFlight``. The next
``step`` schedules and launches the following step first - its inputs take each in-flight token straight from that
device tensor (``step_tokens``) - and only then waits for the event and hands the tokens to the host's per-token
work (stop checks, detokenisation, events). The GPU therefore always has the next step queued while the host
works; the host reads nothing from the device per step but the sampled ids.

Consequences, all handled by the engine:
  * the host learns a token one step late: the scheduler counts it (``Request.num_inflight``) and the next step
    already runs it; when it turns out to end its request (EOS, a stop string, a grammar's end), the step that
    ran it also sampled one more token, which is discarded unseen, and the request's pages - the slot that step
    wrote included - are released when it finishes;
  * a page whose last token is still in flight is offered to the prefix cache one commit later;
  * requests whose next token needs the host (``needs_host``) are sampled on the host, in a step that the engine
    resolves at once, before it schedules the next one; so is every step of an engine with a speculator (its
    drafts are proposed from the tokens the host holds).

On the CPU the "device" is the CPU and the copy is immediate: the same code runs, in the same order.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..pinned import PinnedRing
from .request import Request
from .sampling import SamplingParams, on_device
from .spec.drafter import NO_DRAFT


def needs_host(params: SamplingParams) -> bool:
    """Whether a request's next token needs host work between two steps, so that it cannot be sampled a step ahead:
    penalties (over the output history the host holds), a grammar (its matcher advances on the host, token by
    token), logprobs (their values are read back with the token). Temperature, top-k, top-p, min-p and logit_bias
    are applied on the device."""
    return params.has_penalties or params.grammar is not None or params.logprobs is not None


class InFlight:
    """Tokens sampled on the device for ``requests`` (row i: requests[i]) whose copy to the host is under way."""

    def __init__(self, requests: Sequence[Request], ids: torch.Tensor, may_fail: bool, ring: PinnedRing):
        """``ring``: the engine's pinned buffers for these copies, used in turn (two steps' ids are alive at once:
        the one being read and the next)."""
        self.requests = list(requests)
        self.rows = {r: i for i, r in enumerate(self.requests)}
        # what the next step runs: a failed row (-1) becomes a valid id (its request fails when read)
        self.feed = ids.clamp(min=0) if may_fail else ids
        self._ids: list[int] | None = None
        if ids.device.type == "cuda":
            n = ids.numel()
            ring.reserve(n)
            self._slot, buf = ring.next()
            self._host: torch.Tensor | None = buf[:n]
            self._host.copy_(ids, non_blocking=True)
            ring.copied(self._slot)
            self._ring: PinnedRing | None = ring
        else:
            self._host, self._ring = ids, None

    def mark(self) -> None:
        """Count each (still running) request's token as in flight."""
        for r in self.requests:
            if not r.is_finished:
                r.num_inflight += 1

    def read(self) -> list[int]:
        """Wait for the copy and return the ids (-1: sampling failed for that row); clears the in-flight marks (the
        first read; a later one returns the same ids)."""
        if self._ids is None:
            if self._ring is not None:
                self._ring.wait(self._slot)
            for r in self.requests:
                if r.num_inflight:
                    r.num_inflight -= 1
            self._ids = self._host.tolist()
            self._host = None  # the ring's buffer serves a later step
        return self._ids


def step_tokens(chunks, drafts: dict, inflight: InFlight | None, device: torch.device) -> torch.Tensor:
    """The step's input ids [T] (int64, on ``device``): each chunk's tokens, then its draft's. A position whose
    token is still in flight is taken from ``inflight.feed`` on the device; when every token of the step is one
    (a decode step of the same requests), that tensor itself is the input, with no copy at all."""
    if inflight is not None and not drafts and len(chunks) == len(inflight.requests):
        for c, q in zip(chunks, inflight.requests):
            if c.request is not q or c.length != 1 or c.start != len(q.token_ids):
                break
        else:
            return inflight.feed  # (that decode step, told without building the lists below)
    host: list[int] = []
    dst: list[int] = []
    src: list[int] = []
    for c in chunks:
        r = c.request
        known = min(c.start + c.length, len(r.token_ids))
        host += r.token_ids[c.start:known]
        if known < c.start + c.length:  # the chunk's last position: the token in flight
            if inflight is None or r not in inflight.rows or c.start + c.length != known + 1:
                raise RuntimeError(f"request {r.request_id}: a token to run is neither known nor in flight")
            dst.append(len(host))
            src.append(inflight.rows[r])
            host.append(0)
        host += list(drafts.get(r, NO_DRAFT).tokens)
    if not dst:
        return on_device(host, torch.long, device)
    assert inflight is not None
    if dst == list(range(len(host))) and src == list(range(len(inflight.requests))):
        return inflight.feed
    tokens = on_device(host, torch.long, device)
    if src == list(range(len(inflight.requests))):
        values = inflight.feed
    else:
        values = inflight.feed.index_select(0, on_device(src, torch.long, device))
    return tokens.index_copy_(0, on_device(dst, torch.long, device), values)
