"""The replayable form of a request trace, whatever file format it came from (``readers``), and its ideal hit rate.

A trace is a list of requests in arrival order. Each request names its input by ``hash_ids``: one id per block of
``block_size`` tokens, equal ids meaning equal tokens (and, since blocks are hashed as a prefix chain in the
published traces, an equal prefix up to that block). ``scope`` namespaces the ids: "" for a trace whose ids are
global, the conversation's id for traces whose ids are local to a conversation.

Timing is a dependency graph, so that closed-loop sessions replay as clients would send them: a request is sent
``delay_s`` seconds after the last of the requests in ``after`` has finished (a session's previous turn, the
sub-agents it waited for), or ``delay_s`` seconds after the replay starts when ``after`` is empty.

``ideal_hit_tokens``: the prompt tokens an infinite prefix cache could serve, request by request in trace order:
the longest prefix of the request's blocks whose tokens appeared in earlier requests (a block counts for as many
of its tokens as were seen), at most all but the last prompt token (the engine computes at least one).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    index: int
    session: str | None  # the conversation (or sub-agent) it belongs to; None for sessionless rows
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int
    scope: str = ""
    after: tuple[int, ...] = ()
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.input_length <= 0 or self.output_length <= 0:
            raise ValueError(f"request {self.index}: input and output lengths must be positive, got "
                             f"{self.input_length}, {self.output_length}")
        if self.block_size <= 0:
            raise ValueError(f"request {self.index}: block_size must be positive, got {self.block_size}")
        if any(a >= self.index for a in self.after):
            raise ValueError(f"request {self.index}: it can only wait for earlier requests, got {self.after}")
        if self.delay_s < 0:
            raise ValueError(f"request {self.index}: negative delay {self.delay_s}")

    def block_len(self, i: int) -> int:
        """Tokens of block i in this request's input (the last block may be partial, or padded past the ids)."""
        return max(0, min(self.block_size, self.input_length - i * self.block_size))


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]

    def __post_init__(self) -> None:
        for i, r in enumerate(self.requests):
            if r.index != i:
                raise ValueError(f"trace {self.name}: request {i} has index {r.index}")

    @property
    def sessions(self) -> list[str]:
        return sorted({r.session for r in self.requests if r.session is not None})

    def last_of_session(self) -> set[int]:
        """Indices of each session's last request."""
        last: dict[str, int] = {}
        for r in self.requests:
            if r.session is not None:
                last[r.session] = r.index
        return set(last.values())

    def ideal_hit_tokens(self) -> list[int]:
        seen: dict[tuple[str, int], int] = {}  # (scope, id) -> most tokens of that block seen so far
        out = []
        for r in self.requests:
            hit = 0
            for i, hid in enumerate(r.hash_ids):
                n = r.block_len(i)
                if n == 0:
                    break
                got = min(n, seen.get((r.scope, hid), 0))
                hit += got
                if got < n:
                    break
            out.append(min(hit, r.input_length - 1))
            for i, hid in enumerate(r.hash_ids):
                key = (r.scope, hid)
                seen[key] = max(seen.get(key, 0), r.block_len(i))
        return out

    def working_set_tokens(self) -> int:
        """Distinct prompt tokens of the whole trace (every block counted once, at the most tokens seen)."""
        seen: dict[tuple[str, int], int] = {}
        extra = 0
        for r in self.requests:
            for i, hid in enumerate(r.hash_ids):
                key = (r.scope, hid)
                seen[key] = max(seen.get(key, 0), r.block_len(i))
            extra += max(0, r.input_length - len(r.hash_ids) * r.block_size)  # tokens past the ids: private
        return sum(seen.values()) + extra

    def stats(self) -> dict:
        ideal = self.ideal_hit_tokens()
        prompt = sum(r.input_length for r in self.requests)
        return {"name": self.name, "requests": len(self.requests), "sessions": len(self.sessions),
                "prompt_tokens": prompt, "output_tokens": sum(r.output_length for r in self.requests),
                "max_input": max((r.input_length for r in self.requests), default=0),
                "ideal_hit_rate": sum(ideal) / prompt if prompt else 0.0,
                "working_set_tokens": self.working_set_tokens()}

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests (their dependencies are earlier, so the prefix is a trace)."""
        return Trace(self.name, self.requests[:n])

