"""Which path runs a step of several decode tokens on the megakernel backend, decided by what each path measured.

A step of B single-token segments can run as B replays of the M = 1 megakernel (each near the batch-1 floor, so B
times it) or as one call of the prefill path (weights read once, but a fixed cost of many kernel launches). Which
is faster depends on the model, the GPU and B (on an H100, Llama-3.2-1B: 2.1 ms of replays against 5.3 ms for one
call at B = 2, 8.5 against 5.2 ms at B = 8; bench/NOTES.md, "Multi-token steps"), so the router measures instead of
assuming: it keeps the time of one replay (per token) and of one prefill-path call per bucket of B (powers of two),
and picks the cheaper estimate. A path with no estimate yet for a bucket is tried first (the prefill path, then
replays); the first time of each (path, bucket) is dropped as warm-up (compilation, graph capture); every
``refresh`` steps of a bucket the path not taken runs once so that its estimate follows the GPU.

Pure Python: the backend times each step with CUDA events and hands the times in (``observe``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..step_costs import bucket  # the power of two at or above a size

REPLAY = "replay"
BATCHED = "batched"


@dataclass
class StepRouter:
    refresh: int = 256  # decisions of one bucket between two runs of the path not taken
    weight: float = 0.2  # of a new time in its running estimate
    replay_ms: float | None = None  # one M = 1 megakernel step
    batched_ms: dict[int, float] = field(default_factory=dict)  # bucket -> one prefill-path call
    _seen: set = field(default_factory=set)  # (path, bucket) whose warm-up time was dropped
    _count: dict[int, int] = field(default_factory=dict)  # decisions per bucket

    def choose(self, batch: int) -> str:
        if batch == 1:
            return REPLAY  # one token: the megakernel is the batch-1 path
        b = bucket(batch)
        n = self._count.get(b, 0) + 1
        self._count[b] = n
        if b not in self.batched_ms:
            return BATCHED
        if self.replay_ms is None:
            return REPLAY
        best = REPLAY if batch * self.replay_ms < self.batched_ms[b] else BATCHED
        if n % self.refresh == 0:
            return BATCHED if best == REPLAY else REPLAY
        return best

    def observe(self, path: str, batch: int, ms: float) -> None:
        """A step of ``batch`` decode tokens took ``ms`` on ``path``."""
        if ms <= 0:
            raise ValueError(f"a step's time must be positive, got {ms}")
        if path not in (REPLAY, BATCHED):
            raise ValueError(f"unknown path {path!r}")
        key = (path, 1 if path == REPLAY else bucket(batch))
        if key not in self._seen:  # warm-up: compilation, autotuning, graph capture
            self._seen.add(key)
            return
        if path == REPLAY:
            per = ms / batch
            self.replay_ms = per if self.replay_ms is None else (1 - self.weight) * self.replay_ms + self.weight * per
        else:
            b = bucket(batch)
            old = self.batched_ms.get(b)
            self.batched_ms[b] = ms if old is None else (1 - self.weight) * old + self.weight * ms
