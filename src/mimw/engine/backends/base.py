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
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Sequence

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

    @abstractmethod
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """tokens [T] (int64, the segments' tokens concatenated) -> logits [sum(num_logits), vocab] fp32."""

    @property
    def step_costs(self) -> StepCosts:
        """The times of this backend's steps by token count (``timed_forward`` measures them)."""
        return self.__dict__.setdefault("_step_costs", StepCosts())

    def timed_forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """``forward``, timed into ``step_costs``: on a GPU by CUDA events around the step's work, folded in once
        they completed (a later call looks; nothing waits for the GPU), elsewhere by the wall clock."""
        pending = self.__dict__.setdefault("_step_events", [])
        for item in list(pending):
            n, start, end = item
            if end.query():
                self.step_costs.observe(n, start.elapsed_time(end))
                pending.remove(item)
        n = int(tokens.numel())
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.forward(tokens, segments, cache)
            end.record()
            pending.append((n, start, end))
            return out
        t0 = time.perf_counter()
        out = self.forward(tokens, segments, cache)
        self.step_costs.observe(n, (time.perf_counter() - t0) * 1e3)
        return out
