"""Synthetic agent traces in the kv-cache-tester conversation format (``readers.agent_trace`` reads them back).

What a coding-agent session looks like, and what the generator reproduces:
  * every session of the agent starts with the same system prompt and tool definitions (shared blocks);
  * each turn's input is the previous turn's input plus its output plus new tool output, so every turn's prefix
    is the whole previous context and the input grows over the session;
  * between turns the client thinks or runs a tool: heavy-tailed gaps of seconds (log-normal, capped);
  * sometimes a turn spawns sub-agents that fork the session's context (or only the shared prefix), run a few
    turns of their own, and the parent continues once they are done;
  * sessions start spread over ``ramp_s`` seconds and run concurrently.
Sizes are drawn from log-normal distributions around the given medians; ``max_context`` ends a session whose next
input would not fit the model. Ids are global (``hash_id_scope: "global"``): the shared prefix has the same ids in
every session. Deterministic for a given config.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AgentTraceConfig:
    sessions: int = 8
    min_turns: int = 4
    max_turns: int = 8
    system_tokens: int = 1500
    tool_tokens: int = 6000
    first_user_tokens: int = 400  # median
    tool_output_tokens: int = 300  # median of each turn's new tool output (heavy tail, sigma 1)
    output_tokens: int = 100  # median
    think_s: float = 2.0  # median gap between turns
    max_think_s: float = 60.0
    subagent_prob: float = 0.1  # chance that a turn spawns sub-agents
    max_subagents: int = 3
    subagent_turns: int = 3
    subagent_context: str = "full"  # "full": a sub-agent forks the parent's context; "system": only the shared prefix
    ramp_s: float = 10.0
    max_context: int = 8192
    block_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("sessions", "min_turns", "first_user_tokens", "tool_output_tokens", "output_tokens", "block_size",
                  "max_context", "subagent_turns"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns ({self.min_turns})")
        if self.subagent_context not in ("full", "system"):
            raise ValueError(f"subagent_context must be 'full' or 'system', got {self.subagent_context!r}")
        if self.system_tokens + self.tool_tokens + 2 * self.first_user_tokens >= self.max_context:
            raise ValueError("max_context leaves no room for a turn after the shared prefix")


class _Context:
    """A growing input: its length and one id per block (a partial last block gets a new id when it grows)."""

    def __init__(self, ids: list[int], length: int, block: int):
        self.ids, self.length, self.block = ids, length, block

    def copy(self) -> "_Context":
        return _Context(list(self.ids), self.length, self.block)

    def extend(self, n: int, new_id) -> None:
        full = self.length // self.block
        self.length += n
        self.ids = self.ids[:full] + [new_id() for _ in range(full, -(-self.length // self.block))]


class _Gen:
    def __init__(self, cfg: AgentTraceConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(self.rng.gauss(0.0, sigma))

    def size(self, median: int, sigma: float) -> int:
        return max(1, int(round(self.lognormal(median, sigma))))

    def think(self) -> float:
        return round(min(self.lognormal(self.cfg.think_s, 1.0), self.cfg.max_think_s), 3)

    def turns(self, ctx: _Context, n_turns: int, t0: float, allow_sub: bool, shared: _Context) -> list[dict]:
        """Requests of one session from ``ctx`` (its first input), with sub-agent groups when allowed."""
        cfg, out, t = self.cfg, [], t0
        for k in range(n_turns):
            o = self.size(cfg.output_tokens, 0.6)
            if ctx.length + o > cfg.max_context:
                break
            think = 0.0 if k == 0 else self.think()
            t += think
            out.append({"t": round(t, 3), "type": "s", "in": ctx.length, "out": o, "hash_ids": list(ctx.ids),
                        "think_time": think})
            t += (ctx.length / 20000 + o / 50)  # a nominal server time, for the original-pace timestamps
            ctx.extend(o, self.new_id)
            if allow_sub and self.rng.random() < cfg.subagent_prob:
                group = []
                for _ in range(self.rng.randint(1, cfg.max_subagents)):
                    sub = (ctx if cfg.subagent_context == "full" else shared).copy()
                    sub.extend(self.size(cfg.first_user_tokens, 0.5), self.new_id)
                    reqs = self.turns(sub, cfg.subagent_turns, t, False, shared)
                    if reqs:
                        group.append({"type": "subagent", "t": round(t, 3), "requests": reqs})
                out += group
                t += 5.0 * bool(group)
            new = min(self.size(cfg.tool_output_tokens, 1.0), cfg.max_context // 4)
            if ctx.length + new > cfg.max_context:
                break
            ctx.extend(new, self.new_id)
        return out


def generate(cfg: AgentTraceConfig) -> list[dict]:
    """The conversations of one synthetic agent trace, as kv-cache-tester-style records."""
    g = _Gen(cfg)
    shared = _Context([], 0, cfg.block_size)
    shared.extend(cfg.system_tokens + cfg.tool_tokens, g.new_id)
    convs = []
    for k in range(cfg.sessions):
        ctx = shared.copy()
        ctx.extend(g.size(cfg.first_user_tokens, 0.5), g.new_id)
        reqs = g.turns(ctx, g.rng.randint(cfg.min_turns, cfg.max_turns), 0.0, True, shared)
        convs.append({"id": f"agent-{k:03d}", "models": ["synthetic"], "block_size": cfg.block_size,
                      "hash_id_scope": "global", "tool_tokens": cfg.tool_tokens, "system_tokens": cfg.system_tokens,
                      "start": round(g.rng.uniform(0, cfg.ramp_s), 3), "requests": reqs,
                      "generator": asdict(cfg) if k == 0 else None})
    for c in convs:
        if c["generator"] is None:
            del c["generator"]
    return convs
