"""Backend: what the engine needs from a device to run one step. Two implementations: ``reference`` (PyTorch, any
device) and, later, the Hopper megakernel; the engine never knows which one it drives.

A step is a list of ``Segment``s (``mimw.models.reference``): each is ``length`` new tokens of one sequence at
positions start .. start+length-1, with the sequence's block table in the ``mimw.kv.pages`` layout.

Invariants every backend keeps:
  * ``forward`` writes the K/V of every new token into ``cache`` at the slot its block table names, and reads
    positions [0, start) of a segment only from ``cache`` (pages may be shared with other sequences: a backend
    never writes a position it was not given).
  * Segments of one step are independent sequences: a token attends to its own sequence only, causally.
  * The block table of a segment covers every position it writes (the engine allocates pages before the call).
  * It returns fp32 logits [sum(num_logits), vocab]: a row for each of a segment's last ``num_logits`` tokens
    (``Segment.num_logits``, 1 for decode and prefill), in segment order, and changes nothing else of the
    engine's state.
  * A sequence's logits do not depend on which other sequences share the step beyond floating-point
    reassociation (no cross-sequence state).
  * ``tokens`` lives on ``device`` (the engine builds it there) and may hold ids that the previous step sampled
    and the host has not read yet (``engine/overlap.py``): a backend reads them on the device only, never with
    ``.item()``/``.tolist()``/``int()``, and reads nothing back from the device during ``forward`` (no host
    synchronisation), so that the engine can queue the next step while this one runs.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from ...kv.pages import KVLayout, PagedKVCache
from ...models.reference import Segment
from ...models.spec import ModelSpec
from ..step_costs import StepCosts


class Backend(ABC):
    spec: ModelSpec

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the KV cache must live."""

    @property
    def kv_dtype(self) -> torch.dtype:
        """Element type of the KV pool this backend reads and writes (``mimw.kv.pages``: fp32, bf16 or fp8 with
        per-row scales); chosen at construction, where a backend refuses the types it cannot serve."""
        return torch.float32

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        return PagedKVCache(KVLayout.for_spec(self.spec, page_size, num_pages, self.kv_dtype), self.device)

    def prepare(self, cache: PagedKVCache, max_batch: int = 1) -> None:
        """Before serving: compile every kernel a step over ``cache`` can launch, and capture the graphs of decode
        steps of up to ``max_batch`` sequences, so that no step waits for a compiler or a capture (a serving step
        that did would stall every stream). Nothing to do for a backend of eager ops."""

    @abstractmethod
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """tokens [T] (int64 on ``device``, the segments' tokens concatenated) -> logits [sum(num_logits), vocab] fp32
        on ``device``."""

    @property
    def step_costs(self) -> StepCosts:
        """The times of this backend's steps by token count (``timed_forward`` measures them)."""
        return self.__dict__.setdefault("_step_costs", StepCosts())

    def timed_forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """``forward``, timed into ``step_costs``: on a GPU by CUDA events (``EventTimer``), elsewhere by the wall
        clock."""
        n = int(tokens.numel())
        if self.device.type == "cuda":
            timer: EventTimer = self.__dict__.setdefault("_step_timer", EventTimer())
            for tokens_done, ms in timer.completed():
                self.step_costs.observe(tokens_done, ms)
            start = timer.start()
            out = self.forward(tokens, segments, cache)
            timer.stop(start, n)
            return out
        t0 = time.perf_counter()
        out = self.forward(tokens, segments, cache)
        self.step_costs.observe(n, (time.perf_counter() - t0) * 1e3)
        return out


class EventTimer:
    """Times of GPU work between CUDA events, read once the work completed: ``completed()`` hands back the finished
    ones and keeps the rest, so nothing ever waits for the GPU. Events whose time has been read are recorded again
    by later spans (a step times itself every step: no new event object a span once the pool holds enough)."""

    POOL = 16  # read events kept for reuse

    def __init__(self, make_event: Callable[[], torch.cuda.Event] | None = None) -> None:
        self._make = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pending: list[tuple[object, torch.cuda.Event, torch.cuda.Event]] = []
        self._free: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        ev = self._free.pop() if self._free else self._make()
        ev.record()
        return ev

    def start(self) -> torch.cuda.Event:
        return self._event()

    def stop(self, start: torch.cuda.Event, key: object) -> None:
        """The work queued since ``start`` ends here; ``key`` comes back with its time."""
        self._pending.append((key, start, self._event()))

    def completed(self) -> list[tuple[object, float]]:
        """(key, ms) of every timed span whose end the GPU has reached, in the order they were timed."""
        done, left = [], []
        for key, start, end in self._pending:
            if end.query():
                done.append((key, start.elapsed_time(end)))
                if len(self._free) < self.POOL:
                    self._free += (start, end)
            else:
                left.append((key, start, end))
        self._pending = left
        return done
