"""Where a profiled run's GPU idled, and what the host was doing meanwhile (pure Python over time spans; ``spans``
reads them from a ``torch.profiler`` run).

The overlap bench's question is whether the device waits for the host between steps: the device's busy intervals
(kernels and copies, merged) leave gaps; each gap of at least ``min_gap_us`` is charged to the host calls that
overlap it (CUDA runtime calls and ATen ops, by overlapped time), the rest of it to host code that made no such
call (Python: scheduling, bookkeeping). Host spans include the engine's named phases (``mimw.*``,
``mimw.profiling.phase``), so that rest is charged to the step's phase that ran it. Each gap is also placed between
the device ops around it (the one that ended at its start and the one that began at its end), which says where in a
step the device waits. ``summary`` returns the busy share, the gaps by size, gap time by host call and by device op
pair, and the largest gaps with their host calls; ``format_summary`` prints it.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

BUCKETS_US = (50.0, 200.0, 1000.0)  # gaps counted as >= each
HOST_PREFIXES = ("cuda", "cu", "aten::", "mimw.")  # host spans: CUDA runtime calls, ATen ops, the engine's phases


@dataclass(frozen=True)
class Span:
    start_us: float
    end_us: float
    name: str


def merged(spans: Sequence[Span]) -> list[tuple[float, float]]:
    """The union of the spans' intervals, in order."""
    out: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start_us):
        if out and s.start_us <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.end_us)
        else:
            out.append([s.start_us, s.end_us])
    return [(a, b) for a, b in out]


def _between(busy: Sequence[tuple[float, float]], min_gap_us: float) -> list[tuple[float, float]]:
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]


def gaps(device: Sequence[Span], min_gap_us: float) -> list[tuple[float, float]]:
    """The device's idle intervals of at least ``min_gap_us`` between its first and last busy moment."""
    return _between(merged(device), min_gap_us)


def charge(gap: tuple[float, float], host: Sequence[Span]) -> dict[str, float]:
    """The gap's time by the host calls that overlap it (their overlap, per name: nested calls each count, so the
    names may add up past the gap), and ``(no call)`` for the time no call covers."""
    a, b = gap
    by: dict[str, float] = defaultdict(float)
    covered = []
    for s in host:
        lo, hi = max(a, s.start_us), min(b, s.end_us)
        if hi > lo:
            by[s.name] += hi - lo
            covered.append(Span(lo, hi, s.name))
    by["(no call)"] = (b - a) - sum(y - x for x, y in merged(covered))
    return dict(by)


def short(name: str, width: int = 40) -> str:
    """A device op's name cut to its function (no ``void``, template or argument lists), at most ``width``."""
    name = name.removeprefix("void ").replace("(anonymous namespace)", "")
    for c in "<(":
        name = name.split(c, 1)[0]
    return name.rsplit("::", 1)[-1][:width] or "?"


def around(idle: Sequence[tuple[float, float]], device: Sequence[Span]) -> dict[str, float]:
    """The gaps' time by the device ops around them (``before -> after``: the op that ended last at or before a
    gap's start, the one that began first at or after its end), largest first."""
    by_end = sorted(device, key=lambda s: s.end_us)
    ends = [s.end_us for s in by_end]
    by_start = sorted(device, key=lambda s: s.start_us)
    starts = [s.start_us for s in by_start]
    out: dict[str, float] = defaultdict(float)
    for a, b in idle:
        i = bisect.bisect_right(ends, a) - 1
        j = bisect.bisect_left(starts, b)
        before = short(by_end[i].name) if i >= 0 else "(start)"
        after = short(by_start[j].name) if j < len(by_start) else "(end)"
        out[f"{before} -> {after}"] += b - a
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def busy_by_op(device: Sequence[Span], steps: int) -> dict[str, float]:
    """The device's time by op (``short`` names), in us a step over ``steps`` steps, largest first."""
    out: dict[str, float] = defaultdict(float)
    for d in device:
        out[short(d.name)] += (d.end_us - d.start_us) / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summary(device: Sequence[Span], host: Sequence[Span], min_gap_us: float = 20.0, top: int = 5) -> dict:
    if not device:
        return {"busy_share": 0.0, "window_us": 0.0, "gaps": {}, "largest": []}
    busy = merged(device)
    window = busy[-1][1] - busy[0][0]
    idle = _between(busy, min_gap_us)
    by_size = {f">={int(t)}us": {"count": sum(b - a >= t for a, b in idle),
                                 "us": sum(b - a for a, b in idle if b - a >= t)} for t in BUCKETS_US}
    by_size[f">={int(min_gap_us)}us"] = {"count": len(idle), "us": sum(b - a for a, b in idle)}
    largest = sorted(idle, key=lambda g: g[0] - g[1])[:top]
    charged = {g: charge(g, host) for g in idle}
    total = defaultdict(float)  # every gap's time by host call
    for by in charged.values():
        for k, v in by.items():
            total[k] += v
    return {"busy_share": sum(b - a for a, b in busy) / window if window else 1.0, "window_us": window,
            "gaps": by_size, "gap_time_by_host_call": dict(sorted(total.items(), key=lambda kv: -kv[1])),
            "gap_time_by_device_ops": around(idle, device),
            "largest": [{"at_us": a - busy[0][0], "us": b - a,
                         "host": dict(sorted(charged[(a, b)].items(), key=lambda kv: -kv[1])[:4])}
                        for a, b in largest]}


def format_summary(s: dict) -> str:
    lines = [f"device busy {100 * s['busy_share']:.1f}% of {s['window_us'] / 1e3:.1f} ms; idle gaps: " +
             ", ".join(f"{k} {v['count']} ({v['us'] / 1e3:.2f} ms)" for k, v in s["gaps"].items())]
    calls = list(s.get("gap_time_by_host_call", {}).items())[:6]
    if calls:
        lines.append("gap time by host call: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in calls))
    pairs = list(s.get("gap_time_by_device_ops", {}).items())[:6]
    if pairs:
        lines.append("gap time by device ops around it: " + "; ".join(f"{k} {v / 1e3:.2f} ms" for k, v in pairs))
    for g in s["largest"]:
        lines.append(f"  gap {g['us']:.0f} us at +{g['at_us'] / 1e3:.2f} ms: " +
                     ", ".join(f"{k} {v:.0f} us" for k, v in g["host"].items()))
    return "\n".join(lines)


def spans(prof) -> tuple[list[Span], list[Span]]:
    """(device spans: kernels and copies; host spans: CUDA runtime calls, ATen ops and the engine's phases) of a
    ``torch.profiler`` run."""
    from torch.autograd import DeviceType

    device, host = [], []
    for e in prof.events():
        s = Span(float(e.time_range.start), float(e.time_range.end), e.name)
        if e.device_type == DeviceType.CUDA:
            # a host range's projection on the device timeline (first to last kernel it launched) covers gaps
            if not getattr(e, "is_user_annotation", False) and not e.name.startswith(HOST_PREFIXES):
                device.append(s)
        elif e.name.startswith(HOST_PREFIXES):
            host.append(s)
    return device, host


__all__ = ["Span", "merged", "gaps", "charge", "short", "around", "busy_by_op", "summary", "format_summary", "spans"]
