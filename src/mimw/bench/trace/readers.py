"""Trace files -> ``Trace``: Mooncake-style rows and kv-cache-tester-style agent conversations.

Mooncake rows (one JSON object per line; kvcache-ai/Mooncake, also NVIDIA Dynamo's data generator input):
    {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}       one id per 512-token block
  Without ``session_id`` every row is independent and sent at its timestamp. Dynamo's multi-turn converters add
  ``session_id`` and a per-turn ``delay`` (ms): a session's rows then go one after the other, each ``delay`` after
  the previous one finished (the timestamp gap when there is no ``delay``); a session starts at its first
  timestamp.

Agent conversations (callanjfox/kv-cache-tester ``docs/trace_replay_tester.md``; one JSON object per conversation,
as a .json file, one per line of a .jsonl file, a JSON list, or a directory of .json files):
    {"id", "block_size": 64, "hash_id_scope": "local"|"global", "tool_tokens", "system_tokens",
     "requests": [{"t", "type", "in", "out", "hash_ids", "think_time"?, ...}, {"type": "subagent", "t",
                   "requests": [...]}, ...]}
  A conversation's requests go one after the other: each ``think_time`` after the previous one finished (the ``t``
  gap when there is none). Consecutive ``subagent`` entries start together after the parent's previous request
  (their first request's ``think_time`` later, or the ``t`` gap), as sessions of their own (``<id>/sa<k>``), and
  the parent's next request waits for all of them. Ids are local to
  the conversation unless ``hash_id_scope`` is "global" (the default here is local). A conversation starts at its
  ``start`` (trace seconds; a field of mimw's generator) or at ``k * stagger_s`` replay seconds for the k-th one.

``max_delay_s`` caps every gap and ``time_scale`` multiplies them (kv-cache-tester's ``--max-delay``,
``--time-scale``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .format import Trace, TraceRequest

MOONCAKE_BLOCK = 512
AGENT_BLOCK = 64


class TraceFormatError(ValueError):
    """A trace file mimw cannot read; the message names the file and the record."""


@dataclass(frozen=True)
class Timing:
    time_scale: float = 1.0
    max_delay_s: float = 60.0
    stagger_s: float = 0.0

    def gap(self, seconds: float) -> float:
        return max(0.0, min(seconds, self.max_delay_s)) * self.time_scale


def read_trace(path: str | Path, timing: Timing = Timing(), block_size: int | None = None) -> Trace:
    """Read any supported trace file or directory; ``block_size`` overrides the format's default."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.json"))
        if not files:
            raise TraceFormatError(f"{p}: no .json trace files in this directory")
        records = [_load_json(f) for f in files]
    elif p.is_file():
        records = _records(p)
    else:
        raise TraceFormatError(f"{p}: no such trace file or directory")
    if not records:
        raise TraceFormatError(f"{p}: the trace is empty")
    if all(isinstance(r, dict) and "requests" in r for r in records):
        return agent_trace(p.stem, records, timing, block_size)
    if all(isinstance(r, dict) and "hash_ids" in r and "input_length" in r for r in records):
        return mooncake_trace(p.stem, records, timing, block_size or MOONCAKE_BLOCK)
    raise TraceFormatError(f"{p}: neither Mooncake rows (timestamp, input_length, output_length, hash_ids) nor "
                           "agent conversations (id, requests: [{t, in, out, hash_ids}])")


def _load_json(f: Path) -> Any:
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{f}: not valid JSON: {e}") from None


def _records(f: Path) -> list[Any]:
    text = f.read_text()
    try:
        whole = json.loads(text)
        return whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        pass
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{f}:{n}: not a JSON object: {e}") from None
    return out


def _int(rec: dict, key: str, where: str) -> int:
    v = rec.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise TraceFormatError(f"{where}: {key!r} must be an integer, got {v!r}")
    return v


def _ids(rec: dict, where: str) -> tuple[int, ...]:
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    return tuple(ids)


def _num(rec: dict, key: str, where: str, default: float | None = None) -> float:
    v = rec.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise TraceFormatError(f"{where}: {key!r} must be a number, got {v!r}")
    return float(v)


def mooncake_trace(name: str, rows: list[dict], timing: Timing, block_size: int) -> Trace:
    out: list[TraceRequest] = []
    prev: dict[str, tuple[int, float]] = {}  # session -> (index, timestamp ms) of its previous row
    for i, row in enumerate(rows):
        where = f"{name} row {i + 1}"
        ts = _num(row, "timestamp", where, 0.0)
        sid = row.get("session_id")
        sid = None if sid is None else str(sid)
        after: tuple[int, ...] = ()
        if sid is not None and sid in prev:
            j, prev_ts = prev[sid]
            after = (j,)
            delay = _num(row, "delay", where) / 1000 if "delay" in row else (ts - prev_ts) / 1000
            delay_s = timing.gap(delay)
        else:
            delay_s = max(0.0, ts / 1000) * timing.time_scale
        if sid is not None:
            prev[sid] = (i, ts)
        try:
            out.append(TraceRequest(i, sid, _int(row, "input_length", where), _int(row, "output_length", where),
                                    _ids(row, where), block_size, "", after, delay_s))
        except ValueError as e:
            raise TraceFormatError(f"{where}: {e}") from None
    return Trace(name, tuple(out))


def agent_trace(name: str, convs: list[dict], timing: Timing, block_size: int | None = None) -> Trace:
    out: list[TraceRequest] = []
    for k, conv in enumerate(convs):
        cid = str(conv.get("id", k))
        where = f"{name} conversation {cid}"
        bs = block_size or int(conv.get("block_size", AGENT_BLOCK))
        scope = "" if conv.get("hash_id_scope") == "global" else cid
        start = _num(conv, "start", where) * timing.time_scale if "start" in conv else k * timing.stagger_s
        reqs = conv.get("requests")
        if not isinstance(reqs, list):
            raise TraceFormatError(f"{where}: 'requests' must be a list")
        _session(out, reqs, cid, where, bs, scope, (), start, timing)
    return Trace(name, tuple(out))


def _session(out: list[TraceRequest], reqs: list, sid: str, where: str, bs: int, scope: str,
             after: tuple[int, ...], delay0: float, timing: Timing) -> tuple[int, ...]:
    """Append one session's requests (and its sub-agents' sessions). Its first request waits ``delay0`` after
    ``after`` (after the start when empty); returns the indices its end is (its last request, or the last requests
    of the sub-agents it ended with)."""
    prev_t: float | None = 0.0  # the ``t`` the next gap is measured from (None: right after sub-agents)
    first, n_sub, i = True, 0, 0
    while i < len(reqs):
        rec = reqs[i]
        if not isinstance(rec, dict):
            raise TraceFormatError(f"{where}: entry {i + 1} is not an object")
        if rec.get("type") == "subagent":  # a group of consecutive sub-agents starts together
            ends: list[int] = []
            while i < len(reqs) and isinstance(reqs[i], dict) and reqs[i].get("type") == "subagent":
                sub, n_sub = reqs[i], n_sub + 1
                if not isinstance(sub.get("requests"), list):
                    raise TraceFormatError(f"{where}: sub-agent {n_sub}: 'requests' must be a list")
                head = sub["requests"][0] if sub["requests"] and isinstance(sub["requests"][0], dict) else {}
                gap = timing.gap(_num(head, "think_time", where) if "think_time" in head else
                                 _num(sub, "t", where, prev_t or 0.0) - (prev_t or 0.0))
                ends += _session(out, sub["requests"], f"{sid}/sa{n_sub}", f"{where}/sa{n_sub}", bs, scope, after,
                                 (delay0 if first else 0.0) + gap, timing)
                i += 1
            if ends:
                after, first, prev_t = tuple(sorted(set(ends))), False, None
            continue
        t = _num(rec, "t", where, prev_t or 0.0)
        if first:
            delay = delay0
        elif "think_time" in rec:
            delay = timing.gap(_num(rec, "think_time", where))
        else:
            delay = 0.0 if prev_t is None else timing.gap(t - prev_t)
        idx = len(out)
        try:
            out.append(TraceRequest(idx, sid, _int(rec, "in", where), _int(rec, "out", where), _ids(rec, where), bs,
                                    scope, after, delay))
        except ValueError as e:
            raise TraceFormatError(f"{where}: request {i + 1}: {e}") from None
        after, prev_t, first = (idx,), t, False
        i += 1
    return after


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
