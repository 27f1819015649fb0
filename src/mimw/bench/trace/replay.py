"""Replaying a trace: when each request is due (``Clock``), what happened to it (``Outcome``), and the in-process
driver that feeds an ``Engine`` directly (``replay_engine``; ``remote.replay_http`` drives a server instead).

A request is due ``delay_s`` after the last of its ``after`` requests finished (after the start when it has none).
Every request is sent with greedy sampling and ``ignore_eos``, so it generates exactly its trace's output length;
with ``sessions`` on it names its session, and a session's last request closes it (as an agent would at the end
of a conversation). Times are seconds from the start of the replay on one monotonic clock; TTFT runs from the
moment a request was due to its first token, so queueing counts.

Bounds: ``max_duration_s`` (requests not finished by then are aborted and reported as cut) and the trace length
(``Trace.head`` for a count).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...engine.engine import Engine
from ...engine.request import RequestOutput
from ...engine.sampling import SamplingParams
from .format import Trace
from .tokens import TokenSynth


@dataclass
class Outcome:
    index: int
    session: str | None
    prompt_tokens: int
    ideal_tokens: int
    due: float
    status: str = "pending"  # ok | error | cut | skipped
    cached_tokens: int | None = None
    host_cached_tokens: int | None = None
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # when each generated token (or chunk) arrived
    end: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.due if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.due if self.end is not None and self.status == "ok" else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def to_json(self) -> dict:
        return {"index": self.index, "session": self.session, "status": self.status, "error": self.error,
                "prompt_tokens": self.prompt_tokens, "ideal_tokens": self.ideal_tokens,
                "cached_tokens": self.cached_tokens, "host_cached_tokens": self.host_cached_tokens,
                "output_tokens": self.output_tokens, "due": self.due, "ttft": self.ttft, "e2e": self.e2e,
                "end": self.end, "itl_mean": (sum(self.itls) / len(self.itls)) if self.itls else None}


class Clock:
    """Due times of a trace's requests as their dependencies finish."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self._waiting_on = {r.index: set(r.after) for r in trace.requests}
        self._dependents: dict[int, list[int]] = {}
        for r in trace.requests:
            for a in r.after:
                self._dependents.setdefault(a, []).append(r.index)
        self._finish: dict[int, float] = {}
        self._due = {r.index: r.delay_s for r in trace.requests if not r.after}
        self.sent: set[int] = set()

    def finished(self, index: int, t: float) -> None:
        self._finish[index] = t
        for d in self._dependents.get(index, ()):
            self._waiting_on[d].discard(index)
            if not self._waiting_on[d]:
                r = self.trace.requests[d]
                self._due[d] = max(self._finish[a] for a in r.after) + r.delay_s

    def pop_due(self, now: float) -> list[tuple[int, float]]:
        """Requests due by ``now`` and not yet sent, as (index, due time), oldest first."""
        out = sorted((t, i) for i, t in self._due.items() if t <= now)
        for _, i in out:
            del self._due[i]
            self.sent.add(i)
        return [(i, t) for t, i in out]

    def next_due(self) -> float | None:
        return min(self._due.values(), default=None)

    @property
    def done(self) -> bool:
        return len(self._finish) == len(self.trace.requests)


def replay_engine(engine: Engine, trace: Trace, synth: TokenSynth, sessions: bool = True,
                  max_duration_s: float = 600.0, progress=None,
                  steps: list[tuple[float, int]] | None = None) -> list[Outcome]:
    """Replay ``trace`` on ``engine`` in this thread (the engine must be idle); returns one outcome per request.
    ``steps``, where given, receives one (wall seconds of the ``Engine.step`` call, tokens it ran) per step that ran
    (with the overlap scheduler a call's wall time includes the wait for the previous step's tokens, so in steady
    state it is the device's step time)."""
    clock = Clock(trace)
    ideal = trace.ideal_hit_tokens()
    closers = trace.last_of_session()
    out = {r.index: Outcome(r.index, r.session, r.input_length, ideal[r.index], 0.0) for r in trace.requests}
    live: dict[str, tuple[int, object]] = {}  # engine request id -> (trace index, engine Request)
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def on_output(ev: RequestOutput) -> None:
        i, req = live[ev.request_id]
        o, t = out[i], now()
        if ev.token_ids:
            o.token_times.extend([t] * len(ev.token_ids))
            o.output_tokens += len(ev.token_ids)
        if ev.finished:
            o.end, o.cached_tokens = t, ev.cached_tokens
            o.host_cached_tokens = req.num_host_cached_tokens  # type: ignore[attr-defined]
            o.status = "ok" if ev.finish_reason in ("stop", "length") else ("cut" if ev.finish_reason == "abort"
                                                                            else "error")
            o.error = ev.error
            del live[ev.request_id]
            clock.finished(i, t)
            if progress is not None:
                progress(o)

    while not clock.done:
        t = now()
        if t > max_duration_s:
            break
        for i, due in clock.pop_due(t):
            r, o = trace.requests[i], out[i]
            o.due = due
            prompt = synth.prompt(r)
            if len(prompt) + r.output_length > engine.max_model_len:
                o.status, o.error = "skipped", f"{len(prompt)} + {r.output_length} tokens exceed the context"
                clock.finished(i, t)
                continue
            rid = f"trace-{i}"
            live[rid] = (i, None)
            params = SamplingParams(temperature=0.0, max_tokens=r.output_length, ignore_eos=True)
            live[rid] = (i, engine.add_request(rid, prompt, params, on_output,
                                               session_id=r.session if sessions else None,
                                               close_session=sessions and r.session is not None and i in closers))
        if engine.has_work():
            before = engine.stats()
            t_step = time.perf_counter()
            engine.step()
            after = engine.stats()
            if after.steps == before.steps:
                time.sleep(0.001)  # only restores in flight: let the copies run
            elif steps is not None:
                steps.append((time.perf_counter() - t_step, after.step_tokens - before.step_tokens))
        else:
            nxt = clock.next_due()
            if nxt is None:
                break  # nothing runs and nothing will become due
            time.sleep(max(0.0, min(nxt - now(), 0.05)))
    for rid in list(live):  # out of time: what still runs is cut
        engine.abort(rid)
    for o in out.values():
        if o.status == "pending":
            o.status = "cut"
    return [out[i] for i in range(len(trace.requests))]
