"""PNG bar chart of one run: a panel per context, a horizontal bar per backend (ms/step), the floor as a line.

mimw backends are drawn in one colour and peers in another; a bar whose correctness check failed is hatched and
labelled; rows without a timing (unavailable, error, timeout) are listed by name with their status. Uses
matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

from pathlib import Path

from .peers import is_mimw

MIMW_COLOUR, PEER_COLOUR, FAIL_COLOUR = "#d62728", "#1f77b4", "#7f7f7f"


def write_chart(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    contexts = sorted({r["context"] for r in rows})
    if not contexts:
        return
    height = max(2.5, 0.45 * max(sum(1 for r in rows if r["context"] == c) for c in contexts) + 1.2)
    fig, axes = plt.subplots(len(contexts), 1, figsize=(9, height * len(contexts)), squeeze=False)
    for ax, ctx in zip(axes[:, 0], contexts):
        group = [r for r in rows if r["context"] == ctx]
        labels, values, colours, hatches, texts = [], [], [], [], []
        for r in group:
            ms = r.get("ms_per_step")
            failed = r["status"] == "check-failed"
            labels.append(r["backend"])
            values.append(ms or 0.0)
            colours.append(FAIL_COLOUR if failed else MIMW_COLOUR if is_mimw(r["backend"]) else PEER_COLOUR)
            hatches.append("//" if failed else "")
            if ms is None:
                texts.append(r["status"])
            else:
                ratio = r.get("ratio_to_floor")
                texts.append(f"{ms:.3f} ms" + (f"  {ratio:.2f}x floor" if ratio else "") +
                             ("  CHECK FAILED" if failed else ""))
        ys = range(len(group))
        bars = ax.barh(list(ys), values, color=colours)
        for bar, h in zip(bars, hatches):
            bar.set_hatch(h)
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        top = max(values + [0.0]) or 1.0
        for y, v, t in zip(ys, values, texts):
            ax.text(v + top * 0.01, y, t, va="center", fontsize=8)
        fl = next((r["floor_ms"] for r in group if r.get("floor_ms")), None)
        if fl is not None:
            ax.axvline(fl, color="black", linestyle="--", linewidth=1)
            ax.text(fl, -0.7, f" floor {fl:.3f} ms", fontsize=8, va="bottom")
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel("ms per decode step (lower is better)")
        ax.set_title(f"{', '.join(sorted({r['model'] for r in group}))} · context {ctx} · {doc.get('gpu', '?')}",
                     fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
