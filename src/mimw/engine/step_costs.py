"""StepCosts: how long a backend's steps take, by their token count, as this engine measured them.

Speculative decoding pays only where a step of 1 + k tokens costs little more than a step of one: true of a
weight-bound GPU step, false of a backend whose multi-token path is slower (a launch-bound eager pass beside a
one-token megakernel: ~5x on the Llama-3.2-1B shape) or of a compute-bound CPU step. So the draft-length policy asks
this model, not a constant, what one more token costs: ``relative(base, extra)`` = t(base + extra) / t(base), the
running times of steps of those sizes (token counts in power-of-two buckets; the first time of each bucket dropped
as warm-up: compilation, graph capture). Unmeasured sizes answer None and the policy falls back to its configured
cost model, which drafts, so the sizes speculation uses get measured.

The backend's ``timed_forward`` feeds it: CUDA events on the GPU (read once complete, never waited for), the wall
clock on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def bucket(tokens: int) -> int:
    """The power of two at or above ``tokens``."""
    if tokens < 1:
        raise ValueError(f"a step has at least one token, got {tokens}")
    return 1 << (tokens - 1).bit_length()


@dataclass
class StepCosts:
    weight: float = 0.2  # of a new time in its bucket's running estimate
    ms: dict[int, float] = field(default_factory=dict)  # bucket -> running ms of a step
    _seen: set[int] = field(default_factory=set)

    def observe(self, tokens: int, ms: float) -> None:
        if ms <= 0:
            raise ValueError(f"a step's time must be positive, got {ms}")
        b = bucket(tokens)
        if b not in self._seen:  # warm-up
            self._seen.add(b)
            return
        old = self.ms.get(b)
        self.ms[b] = ms if old is None else (1 - self.weight) * old + self.weight * ms

    def relative(self, base: int, extra: int) -> float | None:
        """t(base + extra) / t(base), at least 1; None where either size is unmeasured."""
        a, b = self.ms.get(bucket(base)), self.ms.get(bucket(base + extra))
        if a is None or b is None:
            return None
        return max(b / a, 1.0)
