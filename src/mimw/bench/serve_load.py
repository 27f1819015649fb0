"""The load pattern of ``mimw bench serve``: when each request is sent, how many may be in flight, when to stop.

Arrivals, as vLLM's ``bench serve`` draws them: gaps between requests are gamma-distributed with shape
``burstiness`` and mean 1 / ``rate`` (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular);
``rate`` inf sends everything at once. Requests that carry their own ``arrival_s`` (a replayed trace) keep it.
``max_concurrency`` caps the requests in flight (a request due while the cap is reached waits for a slot).

Bounds: nothing is sent after ``max_duration_s``; requests still running then are cancelled (recorded as errors
"cancelled"), so a run never outlasts its budget by more than the cancellation.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from .serve_client import RequestResult
from .serve_dataset import BenchRequest


@dataclass(frozen=True)
class LoadPattern:
    rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.max_duration_s > 0:
            raise ValueError(f"--max-duration must be > 0, got {self.max_duration_s}")

    def arrival_times(self, requests: Sequence[BenchRequest], rng: random.Random) -> list[float]:
        """Send time of each request in seconds from the start (non-decreasing)."""
        if requests and all(r.arrival_s is not None for r in requests):
            return [float(r.arrival_s) for r in requests]  # type: ignore[arg-type]
        if math.isinf(self.rate):
            return [0.0] * len(requests)
        t, out = 0.0, []
        scale = 1.0 / (self.rate * self.burstiness)
        for i in range(len(requests)):
            if i:
                t += rng.gammavariate(self.burstiness, scale)
            out.append(t)
        return out


Send = Callable[[BenchRequest, RequestResult], Awaitable[None]]


async def run_load(requests: Sequence[BenchRequest], pattern: LoadPattern, send: Send, rng: random.Random,
                   on_done: Callable[[RequestResult], Any] = lambda r: None) -> tuple[list[RequestResult], float]:
    """Send every request per ``pattern``; returns the results (in request order) and the run's duration (first
    send to last completion, or to the cut-off)."""
    times = pattern.arrival_times(requests, rng)
    results = [RequestResult(r.prompt_len, r.output_len) for r in requests]
    slots = asyncio.Semaphore(pattern.max_concurrency or len(requests) or 1)
    t0 = time.perf_counter()
    deadline = t0 + pattern.max_duration_s

    async def one(i: int) -> None:
        delay = t0 + times[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            if time.perf_counter() >= deadline:
                results[i].error = "not sent: --max-duration reached"
                return
            await send(requests[i], results[i])
        on_done(results[i])

    tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    for r in results:
        if not r.ok and r.error is None:
            r.error = "cancelled: --max-duration reached"
            r.end = r.end or end
    finished = [r.end for r in results if r.ok]
    return results, (max(finished) if finished else end) - t0
