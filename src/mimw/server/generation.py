"""One HTTP request's generations: the engine requests behind it (prompts x n choices) merged into one JSON
response or one SSE stream, with latency metrics, client-disconnect handling and cleanup.

Invariant: whatever way a ``Generation`` ends (finished, client gone, cancelled, error), every engine request it
submitted that has not finished is aborted - its KV pages are freed on the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from ..engine.loop import EngineLoop
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from . import protocol as P
from .metrics import ServerMetrics

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Tracker:
    """Latency bookkeeping of one engine request (times from the engine thread's clock)."""

    def __init__(self, t0: float):
        self.t0, self.last = t0, None

    def observe(self, m: ServerMetrics, ev: RequestOutput, t: float) -> None:
        if ev.token_ids:
            if self.last is None:
                m.ttft.observe(t - self.t0)
            else:
                m.itl.observe(t - self.last)
            self.last = t
        if ev.finished:
            m.finished.labels(ev.finish_reason).inc()
            m.generation_tokens.inc(ev.completion_tokens)
            if ev.finish_reason in ("stop", "length"):
                m.e2e.observe(t - self.t0)


class Generation:
    """The engine requests behind one HTTP request (prompts x n choices), merged into one response or stream."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, env: P.Envelope,
                 subs: Sequence[tuple[str, list[int], SamplingParams]], n: int, num_prompts: int):
        """subs: (engine request id, prompt ids, params) per choice, prompt-major (choice k = prompt k // n)."""
        self.loop, self.metrics, self.env, self.subs = loop, metrics, env, subs
        self.n, self.num_prompts = n, num_prompts
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice, event, engine-thread time)
        self.trackers: list[_Tracker] = []
        self.last: list[RequestOutput | None] = [None] * len(subs)

    def submit(self) -> None:
        """Hand every choice to the engine; if one is refused, abort those already in and re-raise."""
        aio = asyncio.get_running_loop()
        try:
            for k, (rid, ids, params) in enumerate(self.subs):
                def on_output(ev: RequestOutput, k: int = k) -> None:  # runs on the engine thread
                    aio.call_soon_threadsafe(self.queue.put_nowait, (k, ev, time.monotonic()))
                self.trackers.append(_Tracker(time.monotonic()))
                self.loop.submit(rid, ids, params, on_output)
        except Exception:
            for rid, _, _ in self.subs[:len(self.trackers)]:
                self.loop.abort(rid)
            raise

    async def _next(self) -> tuple[int, RequestOutput]:
        k, ev, t = await self.queue.get()
        self.trackers[k].observe(self.metrics, ev, t)
        if ev.finished:
            self.last[k] = ev
        return k, ev

    def _abort_unfinished(self) -> None:
        for k, (rid, _, _) in enumerate(self.subs):
            if self.last[k] is None:  # the client went away (or the request failed): stop generating
                self.loop.abort(rid)
                self.metrics.finished.labels("abort").inc()

    def _usage(self) -> dict[str, Any]:
        firsts = [self.last[i * self.n] for i in range(self.num_prompts)]
        done = [ev for ev in self.last if ev is not None]
        prompt = sum(ev.prompt_tokens for ev in firsts if ev is not None)
        self.metrics.prompt_tokens.inc(prompt)
        return P.usage(prompt, sum(ev.completion_tokens for ev in done),
                       sum(ev.cached_tokens for ev in firsts if ev is not None))

    @staticmethod
    def _failure(ev: RequestOutput) -> P.APIError:
        if ev.finish_reason == "error":
            return P.APIError(500, f"generation failed: {ev.error}", "server_error")
        return P.APIError(503, "the request was cancelled by the server (shutting down)", "server_error")

    async def collect(self, request: Request) -> dict[str, Any]:
        texts = [""] * len(self.subs)
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while any(ev is None for ev in self.last):
                try:
                    k, ev = await asyncio.wait_for(self._next(), timeout=DISCONNECT_POLL_S)
                    texts[k] += ev.text
                    if ev.finish_reason in ("error", "abort"):
                        raise self._failure(ev)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # events may flow faster than the poll: check by the clock
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise P.APIError(499, "client disconnected")
        finally:
            self._abort_unfinished()
        choices = [self.env.choice(k, texts[k], ev.finish_reason) for k, ev in enumerate(self.last) if ev]
        return self.env.response(choices, self._usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.env.chat:
                for k in range(len(self.subs)):
                    yield _sse(self.env.chunk(k, "", None, first=True))
            while any(ev is None for ev in self.last):
                k, ev = await self._next()
                if ev.finish_reason in ("error", "abort"):
                    yield _sse(self._failure(ev).body())
                    return
                if ev.text or ev.finished:
                    yield _sse(self.env.chunk(k, ev.text or None, ev.finish_reason))
            if include_usage:
                yield _sse(self.env.usage_chunk(self._usage()))
            else:
                self._usage()
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()
