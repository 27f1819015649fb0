"""The report of `mimw bench steps`: markdown tables and a chart of ms per step versus tokens per step.

The result document (``batch_steps`` writes it as JSON): ``gpu``, ``read_TBps``, ``context``, ``peers`` (names, run
order) and ``rows``, one per (model, step shape): ``model``, ``kind`` ("decode" or "verify"), ``segments``,
``block``, ``tokens``, ``floor_ms``; where measured ``mimw_ms``, ``replay_ms``, ``kernel_ms``, ``batched_ms``, the
decode paths' ``max_rel_err`` / ``argmax_agree`` against each other and ``kernel_max_rel_err`` /
``kernel_argmax_agree`` (the multi-token launch against one pass), or ``error``; per peer ``<peer>_ms``,
``<peer>_max_rel_err`` and ``<peer>_argmax_agree`` (against mimw's logits of the same step), ``<peer>_build_s``,
``<peer>_notes``, or ``<peer>_error``.

mimw's speedup is taken over the best competitor (``batched_peers.COMPETITORS``: the torch peers, not mimw's own
reference decoder). The chart has a panel per model: decode batches as solid lines, verify blocks as one dashed
line per block length K, in one colour per backend (mimw, each peer) and black for the floor; log-log axes, since
steps range from ~1 ms to hundreds. matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

from pathlib import Path

from .peers.batched_peers import COMPETITORS

MIMW_COLOUR, FLOOR_COLOUR = "#d62728", "black"
PEER_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
VERIFY_STYLES = (("--", "s"), (":", "^"), ("-.", "D"))


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def best_peer(row: dict, peers) -> tuple[str, float] | None:
    """(name, ms) of the fastest competitor timed on this row, or None."""
    timed = [(row[f"{p}_ms"], p) for p in peers if p in COMPETITORS and f"{p}_ms" in row]
    return (min(timed)[1], min(timed)[0]) if timed else None


def _step(r: dict) -> str:
    return f"{r['kind']} {r['segments']}x{r['block']}"


def markdown(doc: dict) -> str:
    rows, peers = doc["rows"], doc.get("peers", [])
    lines = [f"{doc.get('gpu', '?')}, {doc.get('read_TBps', 0):.2f} TB/s read, context {doc.get('context', '?')}, "
             f"random weights, bf16, {doc.get('kv_dtype', 'bf16')} KV", "",
             "| model | step | tokens | floor ms | mimw ms | x floor | tok/s | replays ms | kernel ms | one pass ms "
             "| argmax agree | best peer ms | x best peer |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = best_peer(r, peers)
        best_cell = f"{best[1]:.3f} ({best[0]})" if best else "-"
        if "mimw_ms" not in r:
            lines.append(f"| {r['model']} | {_step(r)} | {r['tokens']} | {r['floor_ms']:.3f} | "
                         f"{r.get('error', '?')} | - | - | - | - | - | - | {best_cell} | - |")
            continue
        ms = r["mimw_ms"]
        speedup = f"{best[1] / ms:.2f}x" if best else "-"
        lines.append(f"| {r['model']} | {_step(r)} | {r['tokens']} | {r['floor_ms']:.3f} | {ms:.3f} | "
                     f"{ms / r['floor_ms']:.2f} | {r['tokens'] * 1e3 / ms:.0f} | {_f(r.get('replay_ms'))} | "
                     f"{_f(r.get('kernel_ms'))} | {_f(r.get('batched_ms'))} | "
                     f"{_f(r.get('argmax_agree', r.get('kernel_argmax_agree')))} | {best_cell} | {speedup} |")
    if peers:
        lines += ["", "Peers, each checked against mimw's logits of the same step:", "",
                  "| model | step | peer | ms | x floor | peer / mimw | max rel err | argmax agree | build s | notes |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            for p in peers:
                ms = r.get(f"{p}_ms")
                ratio = ms / r["mimw_ms"] if ms is not None and r.get("mimw_ms") else None
                note = r.get(f"{p}_error") or r.get(f"{p}_notes", "")
                lines.append(f"| {r['model']} | {_step(r)} | {p} | {_f(ms)} | "
                             f"{_f(ms / r['floor_ms'] if ms is not None else None, '.2f')} | {_f(ratio, '.2f')} | "
                             f"{_f(r.get(f'{p}_max_rel_err'), '.4f')} | {_f(r.get(f'{p}_argmax_agree'))} | "
                             f"{_f(r.get(f'{p}_build_s'), '.1f')} | {note} |")
    return "\n".join(lines) + "\n"


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = sorted((r["tokens"], r[key]) for r in rows if r.get(key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def write_chart(doc: dict, path: Path) -> bool:
    """Write the chart to ``path``; False (nothing written) when no row has a timing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows, peers = doc["rows"], doc.get("peers", [])
    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = [("mimw", "mimw_ms", MIMW_COLOUR)] + [
        (p, f"{p}_ms", PEER_COLOURS[i % len(PEER_COLOURS)]) for i, p in enumerate(peers)] + [
        ("floor", "floor_ms", FLOOR_COLOUR)]
    if not any(r.get(key) is not None for r in rows for _, key, _ in backends[:-1]):
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(9.5 * len(models), 5.5), squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        blocks = sorted({r["block"] for r in mine if r["kind"] == "verify"})
        for label, key, colour in backends:
            xs, ys = _series([r for r in mine if r["kind"] == "decode"], key)
            if xs:
                ax.plot(xs, ys, "-o", color=colour, label=f"{label} decode", markersize=4)
            for i, k in enumerate(blocks):
                line, marker = VERIFY_STYLES[i % len(VERIFY_STYLES)]
                xs, ys = _series([r for r in mine if r["kind"] == "verify" and r["block"] == k], key)
                if xs:
                    ax.plot(xs, ys, line, marker=marker, color=colour, label=f"{label} verify K={k}", markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        ax.set_xlabel("tokens per step (decode: B sequences x 1; verify: S segments x K)")
        ax.set_ylabel("ms per step (lower is better)")
        ax.set_title(f"{model} · context {doc.get('context', '?')} · {doc.get('gpu', '?')}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
