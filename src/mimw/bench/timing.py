"""Step timing: per-step CUDA events around each call, median over many (wall clock on the CPU).

The events bracket each step on the stream, so a graph replay is timed as the GPU runs it, while an eager step that
is launch-bound (the CPU enqueues kernels slower than the GPU runs them) is timed with its launch gaps, which is
its real cost. The number of steps adapts to a time budget so that slow backends (eager 8B) do not eat the run.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    mean_ms: float
    min_ms: float
    p90_ms: float
    steps: int

    def to_json(self) -> dict:
        return asdict(self)


def summarize(samples_ms: list[float]) -> Timing:
    if not samples_ms:
        raise ValueError("no samples")
    s = sorted(samples_ms)
    return Timing(statistics.median(s), statistics.fmean(s), s[0], s[min(len(s) - 1, int(0.9 * len(s)))], len(s))


def steps_for_budget(est_ms: float, max_steps: int, budget_s: float, min_steps: int = 10) -> int:
    """How many timed steps fit ``budget_s`` at ``est_ms`` per step, clamped to [min_steps, max_steps]."""
    fit = int(budget_s * 1e3 / max(est_ms, 1e-3))
    return max(min(min_steps, max_steps), min(max_steps, fit))


def time_steps(step: Callable[[], None], device: torch.device, max_steps: int = 100, warmup: int = 3,
               budget_s: float = 3.0) -> Timing:
    """Run ``warmup`` untimed steps, estimate the per-step cost, then time up to ``max_steps`` steps."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    n = steps_for_budget((time.perf_counter() - t0) * 1e3, max_steps, budget_s)
    if not cuda:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            out.append((time.perf_counter() - t) * 1e3)
        return summarize(out)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for a, b in zip(starts, ends):
        a.record()
        step()
        b.record()
    sync()
    return summarize([a.elapsed_time(b) for a, b in zip(starts, ends)])
