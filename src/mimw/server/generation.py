"""One HTTP request's generations: the engine requests behind it (prompts x n choices) merged into one JSON
response or one SSE stream, with logprobs, echo and tool calls in OpenAI's shapes, latency metrics,
client-disconnect handling and cleanup.

Invariant: whatever way a ``Generation`` ends (finished, client gone, cancelled, error), every engine request it
submitted that has not finished is aborted - its KV pages are freed on the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from ..engine.logprobs import TokenLogprob
from ..engine.loop import EngineLoop
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from . import protocol as P
from .logprobs import CompletionLogprobs, TokenTable, chat_logprobs
from .metrics import RequestTracker, ServerMetrics
from .tools import ToolCallParser, call_dict

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class OutputOptions:
    """How the choices' outputs are shaped (beyond text)."""

    logprobs: bool = False  # the requests ask the engine for logprobs
    table: TokenTable | None = None  # built when logprobs are asked
    echo: Sequence[str] | None = None  # completions: each prompt's text, written before its completion
    tool_choice: str | None = None  # "auto", "required" or a function name: parse tool calls
    tool_format: str = "hermes"
    parallel_tool_calls: bool = True


@dataclass
class _Choice:
    """One choice's output so far."""

    prompt_ids: list[int]
    text: str = ""
    entries: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # logprob entries, in order
    pending: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # not yet in a chunk
    started: bool = False
    parser: ToolCallParser | None = None
    completion_lp: CompletionLogprobs | None = None


class Generation:
    """The engine requests behind one HTTP request (prompts x n choices), merged into one response or stream."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, env: P.Envelope,
                 subs: Sequence[tuple[str, list[int], SamplingParams]], n: int, num_prompts: int,
                 out: OutputOptions = OutputOptions(), session_id: str | None = None, close_session: bool = False):
        """subs: (engine request id, prompt ids, params) per choice, prompt-major (choice k = prompt k // n);
        every choice belongs to ``session_id`` (if any)."""
        self.loop, self.metrics, self.env, self.subs, self.out = loop, metrics, env, subs, out
        self.n, self.num_prompts = n, num_prompts
        self.session_id, self.close_session = session_id, close_session
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice, event)
        self.trackers: list[RequestTracker] = []
        self.last: list[RequestOutput | None] = [None] * len(subs)
        self.choices = [_Choice(ids) for _, ids, _ in subs]
        for c in self.choices:
            if out.tool_choice is not None:
                c.parser = ToolCallParser(out.tool_format, out.tool_choice, out.parallel_tool_calls)
            if out.logprobs and not env.chat:
                c.completion_lp = CompletionLogprobs(out.table)

    def submit(self) -> None:
        """Hand every choice to the engine; if one is refused, abort those already in and re-raise."""
        aio = asyncio.get_running_loop()
        try:
            for k, (rid, ids, params) in enumerate(self.subs):
                tracker = self.metrics.tracker(time.monotonic(), params.max_tokens)

                def on_output(ev: RequestOutput, k: int = k, tracker: RequestTracker = tracker) -> None:
                    tracker.observe(ev, time.monotonic())  # engine thread: counts even if the client is gone
                    aio.call_soon_threadsafe(self.queue.put_nowait, (k, ev))
                self.trackers.append(tracker)
                self.loop.submit(rid, ids, params, on_output, self.session_id, self.close_session)
        except Exception:
            for rid, _, _ in self.subs[:len(self.trackers)]:
                self.loop.abort(rid)
            raise

    async def _next(self) -> tuple[int, RequestOutput]:
        k, ev = await self.queue.get()
        if ev.finished:
            self.last[k] = ev
        c = self.choices[k]
        if ev.prompt_logprobs is not None and self.out.echo is not None:
            c.pending.extend(zip(c.prompt_ids, ev.prompt_logprobs))
        c.pending.extend((e.token_id, e) for e in ev.logprobs)
        return k, ev

    def _abort_unfinished(self) -> None:
        for k, (rid, _, _) in enumerate(self.subs):
            if self.last[k] is None:  # the client went away (or the request failed): stop generating
                self.loop.abort(rid)

    def _usage(self) -> dict[str, Any]:
        firsts = [self.last[i * self.n] for i in range(self.num_prompts)]
        done = [ev for ev in self.last if ev is not None]
        prompt = sum(ev.prompt_tokens for ev in firsts if ev is not None)
        return P.usage(prompt, sum(ev.completion_tokens for ev in done),
                       sum(ev.cached_tokens for ev in firsts if ev is not None))

    @staticmethod
    def _failure(ev: RequestOutput) -> P.APIError:
        if ev.finish_reason == "error":
            return P.APIError(500, f"generation failed: {ev.error}", "server_error")
        return P.APIError(503, "the request was cancelled by the server (shutting down)", "server_error")

    def _echo(self, k: int) -> str:
        return self.out.echo[k // self.n] if self.out.echo is not None else ""

    def _logprobs(self, c: _Choice) -> Any:
        """The logprobs object of the entries not yet sent (None when not asked)."""
        if not self.out.logprobs:
            return None
        entries, c.pending = c.pending, []
        c.entries.extend(entries)
        if self.env.chat:
            return chat_logprobs(self.out.table, [e for _, e in entries if e is not None])
        return c.completion_lp.build(entries)

    def _finish_reason(self, c: _Choice, reason: str | None, calls: list) -> str | None:
        if calls and reason == "stop":
            return "stop" if self.out.tool_choice not in ("auto", "required") else "tool_calls"
        return reason

    # --- one JSON response ------------------------------------------------------------------------------------
    async def collect(self, request: Request) -> dict[str, Any]:
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while any(ev is None for ev in self.last):
                try:
                    k, ev = await asyncio.wait_for(self._next(), timeout=DISCONNECT_POLL_S)
                    self.choices[k].text += ev.text
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
        choices = []
        for k, ev in enumerate(self.last):
            c = self.choices[k]
            text, calls = c.text, []
            if c.parser is not None:
                content = c.parser.feed(c.text)
                rest, calls = c.parser.finish()
                text = content + rest
            lp = self._logprobs(c)
            if self.env.chat:
                choices.append(self.env.choice(k, text if text or not calls else None,
                                               self._finish_reason(c, ev.finish_reason, calls), lp,
                                               [call_dict(x) for x in calls]))
            else:
                choices.append(self.env.choice(k, self._echo(k) + text, ev.finish_reason, lp))
        return self.env.response(choices, self._usage())

    # --- one SSE stream ---------------------------------------------------------------------------------------
    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.env.chat:
                for k in range(len(self.subs)):
                    yield _sse(self.env.chunk(k, "", None, first=True, with_usage=include_usage))
            while any(ev is None for ev in self.last):
                k, ev = await self._next()
                if ev.finish_reason in ("error", "abort"):
                    yield _sse(self._failure(ev).body())
                    return
                for chunk in self._chunks(k, ev, include_usage):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(self.env.usage_chunk(self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()

    def _chunks(self, k: int, ev: RequestOutput, with_usage: bool) -> list[dict[str, Any]]:
        c = self.choices[k]
        text = ev.text
        if not self.env.chat and not c.started and self.out.echo is not None:
            text = self._echo(k) + text
        c.started = True
        calls: list = []
        if c.parser is not None:
            text = c.parser.feed(text)
            if ev.finished:
                rest, calls = c.parser.finish()
                text += rest
        out = []
        if ev.finished and calls:
            if text or c.pending:
                out.append(self.env.chunk(k, text, None, logprobs=self._logprobs(c), with_usage=with_usage))
            out.append(self.env.chunk(k, None, None, tool_calls=[call_dict(x, i) for i, x in enumerate(calls)],
                                      with_usage=with_usage))
            out.append(self.env.chunk(k, None, self._finish_reason(c, ev.finish_reason, calls),
                                      with_usage=with_usage))
        elif ev.finished:
            out.append(self.env.chunk(k, text or None, ev.finish_reason, logprobs=self._logprobs(c),
                                      with_usage=with_usage))
        elif text or c.pending:
            out.append(self.env.chunk(k, text, None, logprobs=self._logprobs(c), with_usage=with_usage))
        return out
