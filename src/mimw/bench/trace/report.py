"""Results of a trace replay: per-setup summaries, per-session rows, the JSON document, markdown and a chart.

A setup's summary: requests by status; TTFT, inter-token latency and end-to-end latency (p50/p99, ms, over the
requests that finished); throughput over the makespan (first request due -> last token); hit rates as fractions
of all prompt tokens sent: measured (cached by the engine), split by tier where known, and the trace's ideal
(``Trace.ideal_hit_tokens``) with the measured share of it. ``ttft_p50_vs_first`` compares each setup's p50 TTFT
with the first setup's (the baseline): baseline / setup, so > 1 is faster.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ...engine.step_costs import bucket
from .replay import Outcome


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def step_summary(steps: Sequence[tuple[float, int]]) -> dict:
    """The engine's steps during a replay (``replay_engine``'s step log of (wall seconds, tokens)): their count,
    wall time p50/p90/p99 and total, tokens a step p50/p90, and by token bucket (powers of two) the steps, their
    mean wall time and their share of all step time: where a slow inter-token latency comes from."""
    if not steps:
        return {"steps": 0}
    wall = [w for w, _ in steps]
    toks = [n for _, n in steps]
    total = sum(wall)
    by: dict[int, list[float]] = {}
    for w, n in steps:
        by.setdefault(bucket(n), []).append(w)
    return {"steps": len(steps), "wall_p50_ms": _ms(_pct(wall, 50)), "wall_p90_ms": _ms(_pct(wall, 90)),
            "wall_p99_ms": _ms(_pct(wall, 99)), "wall_total_s": total,
            "tokens_p50": _pct(toks, 50), "tokens_p90": _pct(toks, 90),
            "by_tokens": {str(b): {"steps": len(ws), "mean_ms": sum(ws) / len(ws) * 1e3,
                                   "share": sum(ws) / total if total > 0 else None}
                          for b, ws in sorted(by.items())}}


def summarize(outcomes: Sequence[Outcome]) -> dict:
    ok = [o for o in outcomes if o.status == "ok"]
    sent = [o for o in outcomes if o.status not in ("skipped",)]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    itl = [x for o in ok for x in o.itls]
    prompt = sum(o.prompt_tokens for o in sent)
    cached = sum(o.cached_tokens or 0 for o in sent)
    known = [o for o in sent if o.host_cached_tokens is not None]
    host = sum(o.host_cached_tokens or 0 for o in known) if known else None
    ideal = sum(o.ideal_tokens for o in sent)
    t_first = min((o.due for o in ok), default=0.0)
    t_last = max((o.end for o in ok if o.end is not None), default=0.0)
    span = t_last - t_first
    out_tokens = sum(o.output_tokens for o in ok)
    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("ok", "error", "cut", "skipped")}
    return {
        "requests": len(outcomes), **counts,
        "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "itl_p50_ms": _ms(_pct(itl, 50)), "itl_p99_ms": _ms(_pct(itl, 99)),
        "e2e_p50_ms": _ms(_pct(e2e, 50)), "e2e_p99_ms": _ms(_pct(e2e, 99)),
        "makespan_s": span, "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "total_tokens_per_s": (out_tokens + sum(o.prompt_tokens for o in ok)) / span if span > 0 else None,
        "prompt_tokens": prompt, "hit_rate": cached / prompt if prompt else None,
        "device_hit_rate": (cached - host) / prompt if prompt and host is not None else None,
        "host_hit_rate": host / prompt if prompt and host is not None else None,
        "ideal_hit_rate": ideal / prompt if prompt else None,
        "fraction_of_ideal": cached / ideal if ideal else None,
    }


def per_session(outcomes: Sequence[Outcome]) -> list[dict]:
    rows: dict[str, list[Outcome]] = {}
    for o in outcomes:
        rows.setdefault(o.session or "-", []).append(o)
    out = []
    for sid, os_ in sorted(rows.items()):
        s = summarize(os_)
        out.append({"session": sid, "requests": len(os_), "ok": s["ok"], "prompt_tokens": s["prompt_tokens"],
                    "hit_rate": s["hit_rate"], "host_hit_rate": s["host_hit_rate"],
                    "ideal_hit_rate": s["ideal_hit_rate"], "ttft_p50_ms": s["ttft_p50_ms"]})
    return out


def compare(setups: list[dict]) -> None:
    """Add ``ttft_p50_vs_first`` (first setup's p50 TTFT / this one's) to every setup's summary."""
    base = setups[0]["summary"]["ttft_p50_ms"] if setups else None
    for s in setups:
        mine = s["summary"]["ttft_p50_ms"]
        s["summary"]["ttft_p50_vs_first"] = base / mine if base and mine else None


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    t = doc["trace"]
    lines = [f"# Trace replay: {t['name']} on {doc.get('model', '?')} ({doc.get('device', '?')})", "",
             f"{doc.get('date', '?')} · commit `{doc.get('commit', 'unknown')}` · {t['requests']} requests, "
             f"{t['sessions']} sessions, {t['prompt_tokens']} prompt tokens, working set {t['working_set_tokens']} "
             f"tokens · device pool {doc.get('device_pool_tokens', '?')} tokens "
             f"(working set {_f(doc.get('working_set_ratio'), '.1f')}x), host tier "
             f"{doc.get('host_pool_tokens', 0)} tokens", "",
             "| setup | ok/cut/err | TTFT p50 | TTFT p99 | ITL p50 | E2E p50 | E2E p99 | out tok/s | hit rate "
             "(device + host) | ideal | of ideal | TTFT p50 vs first |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for s in doc["setups"]:
        m = s["summary"]
        split = "" if m["host_hit_rate"] is None else \
            f" ({_f(m['device_hit_rate'], '.1%')} + {_f(m['host_hit_rate'], '.1%')})"
        lines.append(f"| {s['name']} | {m['ok']}/{m['cut']}/{m['error']} | {_f(m['ttft_p50_ms'], '.0f')} ms | "
                     f"{_f(m['ttft_p99_ms'], '.0f')} ms | {_f(m['itl_p50_ms'], '.1f')} ms | "
                     f"{_f(m['e2e_p50_ms'], '.0f')} ms | {_f(m['e2e_p99_ms'], '.0f')} ms | "
                     f"{_f(m['output_tokens_per_s'], '.1f')} | {_f(m['hit_rate'], '.1%')}{split} | "
                     f"{_f(m['ideal_hit_rate'], '.1%')} | {_f(m['fraction_of_ideal'], '.1%')} | "
                     f"{_f(m['ttft_p50_vs_first'], '.2f')}x |")
    lines += ["", "Hit rates are shares of all prompt tokens sent; ideal = what an infinite prefix cache could serve "
              "(blocks already seen, in trace order). TTFT counts from the moment a request was due.", ""]
    for s in doc["setups"]:
        lines += [f"## Per session: {s['name']}", "", "| session | requests | hit rate | of which host | ideal | "
                  "TTFT p50 |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in s["sessions"]:
            lines.append(f"| {r['session']} | {r['requests']} | {_f(r['hit_rate'], '.1%')} | "
                         f"{_f(r['host_hit_rate'], '.1%')} | {_f(r['ideal_hit_rate'], '.1%')} | "
                         f"{_f(r['ttft_p50_ms'], '.0f')} ms |")
        lines.append("")
    return "\n".join(lines)


def short_table(doc: dict) -> str:
    rows = [f"{'setup':<14} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p50':>10} {'hit':>7} {'host':>7} "
            f"{'ideal':>7} {'of ideal':>9} {'vs first':>9}"]
    for s in doc["setups"]:
        m = s["summary"]
        rows.append(f"{s['name']:<14} {_f(m['ttft_p50_ms'], '9.0f')}ms {_f(m['ttft_p99_ms'], '9.0f')}ms "
                    f"{_f(m['e2e_p50_ms'], '9.0f')}ms {_f(m['hit_rate'], '7.1%')} {_f(m['host_hit_rate'], '7.1%'):>7} "
                    f"{_f(m['ideal_hit_rate'], '7.1%')} {_f(m['fraction_of_ideal'], '9.1%')} "
                    f"{_f(m['ttft_p50_vs_first'], '8.2f')}x")
    return "\n".join(rows)


def write_chart(doc: dict, path: Path) -> None:
    """TTFT distribution per setup (left) and hit rate per setup, split by tier, against the ideal (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s in doc["setups"]:
        ttft = sorted(r["ttft"] * 1e3 for r in s["requests"] if r["status"] == "ok" and r["ttft"] is not None)
        if ttft:
            a.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=s["name"])
    a.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    a.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.xaxis.set_minor_formatter(NullFormatter())
    a.set_xlabel("time to first token (ms, log)")
    a.set_ylabel("fraction of requests")
    a.legend(fontsize=8)
    a.set_title("TTFT distribution", fontsize=10)
    names = [s["name"] for s in doc["setups"]]
    dev = [s["summary"]["device_hit_rate"] if s["summary"]["device_hit_rate"] is not None
           else (s["summary"]["hit_rate"] or 0.0) for s in doc["setups"]]
    host = [s["summary"]["host_hit_rate"] or 0.0 for s in doc["setups"]]
    xs = np.arange(len(names))
    b.bar(xs, dev, color="#1f77b4", label="device tier")
    b.bar(xs, host, bottom=dev, color="#ff7f0e", label="host tier")
    ideal = doc["trace"].get("ideal_hit_rate")
    if ideal is not None:
        b.axhline(ideal, color="black", linestyle="--", linewidth=1, label=f"ideal {ideal:.1%}")
    b.set_xticks(xs, names, fontsize=8)
    b.set_ylim(0, 1)
    b.set_ylabel("prompt tokens served from cache")
    b.legend(fontsize=8)
    b.set_title("prefix hit rate", fontsize=10)
    fig.suptitle(f"{doc['trace']['name']} · {doc.get('model', '?')} · {doc.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
