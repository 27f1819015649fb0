"""Which path runs a step of several tokens on the megakernel backend, decided by what each path measured.

A step of B single-token segments (decode) can run as B replays of the M = 1 megakernel (each near the batch-1
floor, so B times it), as one launch of the megakernel's multi-token step (B <= plan.max_tokens: the weights
streamed once on wgmma), or as one pass of the prefill path (weights read once, but a fixed cost of many kernel
launches, graphed where the segments are short). Which is fastest depends on the model, the GPU and B (on an H100,
Llama-3.2-1B at B = 8: 7.8 ms of replays, 5.0 ms for one eager pass, 1.49 ms for the multi-token kernel; a verify
block of 16: 1.96 ms on the kernel, 1.78 ms for the graphed pass; bench/NOTES.md, "Branch `mtnext` measured"), so the
router measures instead of assuming: it keeps the time of one replay (per token) and of each whole-batch path per
bucket of B (powers of two), and picks the cheapest estimate. A path with no estimate yet for a bucket is tried
first (in the order the backend lists them, then replays) until it has ``min_samples`` times; the first time of each
path and size is dropped as warm-up (compilation, graph capture). A path's estimate is the least of its last
``window`` times: a step's time on the GPU's events only ever inflates (the host stalling the queue, a capture or an
allocator's growth the warm-up rule missed), so one slow time must not stick to a path that is then never taken
(bench/NOTES.md, "The router on the 1B's decode 32"), while a GPU that got slower shows once ``window`` new times
replace the old. Every ``refresh`` steps of a bucket the second-best path runs once so that its estimate follows
the GPU. A step with verify blocks has no replay path (``replays=False``): the megakernel's multi-token step or the
pass, estimated per bucket of its token count as decode steps are (the multi-token step runs the same program for
M tokens whatever its segments).

Pure Python: the backend times each step with CUDA events and hands the times in (``observe``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..step_costs import bucket  # the power of two at or above a size

REPLAY = "replay"
BATCHED = "batched"
KERNEL = "kernel"


def step_paths(segments, max_tokens: int, moe: bool) -> tuple[str, ...] | None:
    """The whole-step paths the router may choose for a step of ``segments`` (``Segment``s) on the megakernel
    backend, in the order to try them (a decode step has replays besides), or None where the step is one pass of the
    prefill path: a prefill chunk (a segment wanting fewer logits than it has tokens: the multi-token step plans
    each layout of query blocks anew, which chunk lengths rarely repeat), verify blocks past ``max_tokens`` tokens,
    an MoE model's verify blocks (its pass is the reference decoder)."""
    m = sum(s.length for s in segments)
    decode = all(s.length == 1 and s.num_logits == 1 for s in segments)
    verify = all(s.num_logits == s.length for s in segments)  # decode tokens and verify blocks
    if not decode and (moe or not verify or not 2 <= m <= max_tokens):
        return None
    return ((KERNEL,) if m <= max_tokens else ()) + (() if moe else (BATCHED,))


@dataclass
class StepRouter:
    refresh: int = 256  # decisions of one bucket between two runs of the second-best path
    window: int = 8  # a path's last times its estimate is the least of
    min_samples: int = 2  # times a path needs before it has an estimate
    _times: dict[tuple[str, int], deque] = field(default_factory=dict)  # (path, bucket) -> last ms (replay: a token)
    _seen: set = field(default_factory=set)  # (path, size) whose warm-up time was dropped
    _count: dict[int, int] = field(default_factory=dict)  # decisions per bucket

    def _estimate(self, path: str, b: int) -> float | None:
        t = self._times.get((path, b))
        return min(t) if t is not None and len(t) >= self.min_samples else None

    @property
    def replay_ms(self) -> float | None:
        """One M = 1 megakernel step's estimate (None until measured)."""
        return self._estimate(REPLAY, 1)

    @property
    def step_ms(self) -> dict[str, dict[int, float]]:
        """Each whole-batch path's estimates: path -> bucket -> ms a step."""
        out: dict[str, dict[int, float]] = {}
        for (p, b) in sorted(self._times):
            ms = self._estimate(p, b)
            if p != REPLAY and ms is not None:
                out.setdefault(p, {})[b] = ms
        return out

    @property
    def batched_ms(self) -> dict[int, float]:
        return self.step_ms.get(BATCHED, {})

    def choose(self, batch: int, paths: tuple[str, ...] = (BATCHED,), replays: bool = True) -> str:
        """The path for a step of ``batch`` tokens: replays (a decode step's only, where ``replays``), or one of
        ``paths`` (the whole-batch paths this step may take, in the order to try them while unmeasured)."""
        if batch == 1 and replays:
            return REPLAY  # one token: the megakernel is the batch-1 path
        b = bucket(batch)
        n = self._count.get(b, 0) + 1
        self._count[b] = n
        cost = {p: self._estimate(p, b) for p in paths}
        for p in paths:
            if cost[p] is None:
                return p
        if replays:
            per = self.replay_ms
            if per is None:
                return REPLAY
            cost[REPLAY] = batch * per
        ranked = sorted(cost, key=cost.__getitem__)
        return ranked[1] if n % self.refresh == 0 and len(ranked) > 1 else ranked[0]

    def estimates(self) -> dict:
        """What the router has measured, as JSON: one replay's ms and each whole-batch path's ms by bucket."""
        return {"replay_ms": self.replay_ms,
                "step_ms": {p: {str(b): ms for b, ms in e.items()} for p, e in self.step_ms.items()}}

    def observe(self, path: str, batch: int, ms: float) -> None:
        """A step of ``batch`` decode tokens took ``ms`` on ``path``."""
        if ms <= 0:
            raise ValueError(f"a step's time must be positive, got {ms}")
        if path not in (REPLAY, BATCHED, KERNEL):
            raise ValueError(f"unknown path {path!r}")
        # warm-up: compilation, autotuning, graph capture (the kernel path compiles once per batch size)
        key = (path, 1 if path == REPLAY else batch if path == KERNEL else bucket(batch))
        if key not in self._seen:
            self._seen.add(key)
            return
        b = 1 if path == REPLAY else bucket(batch)
        self._times.setdefault((path, b), deque(maxlen=self.window)).append(ms / batch if path == REPLAY else ms)
