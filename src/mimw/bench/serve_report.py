"""Reports of ``mimw bench serve``: the JSON document (configuration, environment, one summary per run, every
request's timings), a markdown table (one row per run) and a PNG chart (latency distributions per run; with
several request rates, throughput against latency).

Document shape: {"benchmark": "serve", "date", "commit", "mimw", "target", "model", "dataset", "config",
"runs": [{"label", "request_rate", "burstiness", "max_concurrency", "summary", "requests": [...]}]}.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "" if x is None else format(x, fmt)


def _rate(run: dict[str, Any]) -> str:
    r = run["request_rate"]
    return "inf" if r is None or math.isinf(r) else f"{r:g}"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:  # JSON has no inf
        if isinstance(x, float) and math.isinf(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(doc), indent=1))


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Serving benchmark: {doc.get('model', '?')} ({doc.get('dataset', '?')} dataset)", "",
             f"{doc.get('date', '?')} · commit `{doc.get('commit', 'unknown')}` · target {doc.get('target', '?')} · "
             f"endpoint {doc.get('config', {}).get('endpoint', '?')}", "",
             "| rate (req/s) | concurrency | done / sent | req/s | output tok/s | TTFT mean / p50 / p99 (ms) | "
             "TPOT mean / p50 / p99 (ms) | ITL p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in doc["runs"]:
        s = run["summary"]
        t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        lines.append(
            f"| {_rate(run)} | {run['max_concurrency'] or '∞'} | {s['completed']} / {s['requests']} | "
            f"{_f(s['request_throughput'], '.2f')} | {_f(s['output_throughput'])} | "
            f"{_f(t['mean'])} / {_f(t['p50'])} / {_f(t['p99'])} | {_f(p['mean'])} / {_f(p['p50'])} / {_f(p['p99'])} | "
            f"{_f(i['p50'])} / {_f(i['p90'])} / {_f(i['p99'])} | {_f(e['p50'])} / {_f(e['p90'])} / {_f(e['p99'])} |")
    failed = [(run, run["summary"]["errors"]) for run in doc["runs"] if run["summary"]["failed"]]
    if failed:
        lines += ["", "Failed requests: " + "; ".join(
            f"rate {_rate(run)}: " + ", ".join(f"{n} {k}" for k, n in errs.items()) for run, errs in failed)]
    lines += ["", "TTFT: send to first text chunk; TPOT: (E2E - TTFT) / (output tokens - 1); ITL: gaps between "
              "text chunks; E2E: send to last byte; throughputs over first send to last completion. Client-side "
              "times (`mimw bench serve`, definitions as `vllm bench serve`)."]
    return "\n".join(lines) + "\n"


def write_chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    sweep = len(runs) > 1
    fig, axes = plt.subplots(1, 4 if sweep else 3, figsize=(16 if sweep else 12, 3.6))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "inter-token latency", "E2E latency")):
        for run in runs:
            ok = [r for r in run["requests"] if r["ok"]]
            vals = sorted(v * 1e3 for r in ok for v in (r[key] if key == "itl_s" else [r[key]]) if v is not None)
            if vals:
                ax.step(vals, [(k + 1) / len(vals) for k in range(len(vals))], where="post",
                        label=f"rate {_rate(run)}")
        ax.set(title=title, xlabel="ms", ylabel="fraction of " + ("gaps" if key == "itl_s" else "requests"),
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    if sweep:
        ax = axes[3]
        xs = [run["summary"]["output_throughput"] or 0 for run in runs]
        for q in ("p50", "p99"):
            ax.plot(xs, [run["summary"]["tpot_ms"][q] or math.nan for run in runs], marker="o", label=f"TPOT {q}")
            ax.plot(xs, [run["summary"]["ttft_ms"][q] or math.nan for run in runs], marker="s", ls="--",
                    label=f"TTFT {q}")
        ax.set(title="latency vs throughput", xlabel="output tokens/s", ylabel="ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"mimw bench serve: {doc.get('model', '?')}, {doc.get('dataset', '?')} dataset", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
