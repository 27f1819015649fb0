"""PNG timeline of one traced megakernel step: the rate at which all loaders issued weight bytes, microsecond by
microsecond, over the stage windows of the instruction trace, against the measured read bandwidth — where HBM is
kept busy and where it idles. Inputs come from ``trace.summarize`` (stage windows) and ``trace.issue_series``
(the tile trace); matplotlib's Agg backend, no display needed.
"""
from __future__ import annotations

from pathlib import Path

STAGE_COLOURS = {"ATTN_IN": "#1f77b4", "ATTN_PARTIAL": "#ff7f0e", "ATTN_REDUCE": "#ffbb78", "O_PROJ": "#2ca02c",
                 "MLP_IN": "#d62728", "DOWN_PROJ": "#9467bd", "LM_HEAD": "#8c564b"}


def write_timeline(series: tuple[list[float], list[float]], windows: list[dict], path: Path | str, title: str,
                   bandwidth_tbps: float | None = None, layers: int = 3) -> None:
    """``series``: (bin start us, TB/s issued) from ``trace.issue_series``; ``windows``: stage windows from
    ``trace.summarize`` (same launch). The top panel shows the whole step, the bottom one the first ``layers``
    layers in detail."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, rate = series
    end_detail = max((w["last_done_us"] for w in windows if w["op"] != "LM_HEAD" and w["layer"] < layers),
                     default=t[-1] if t else 1.0)
    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5))
    for ax, x1 in zip(axes, (t[-1] + 1 if t else 1.0, end_detail)):
        seen = set()
        for w in windows:
            a, b = w["first_ready_us"], w["last_done_us"]
            if a >= x1:
                continue
            label = None if w["op"] in seen else w["op"]
            seen.add(w["op"])
            ax.axvspan(a, min(b, x1), color=STAGE_COLOURS.get(w["op"], "#cccccc"), alpha=0.18, label=label, lw=0)
        ax.step(t, rate, where="post", color="black", linewidth=0.8, label="issued")
        if bandwidth_tbps:
            ax.axhline(bandwidth_tbps, color="black", linestyle="--", linewidth=0.8)
            ax.text(0, bandwidth_tbps, f" read bandwidth {bandwidth_tbps:.2f} TB/s", fontsize=8, va="bottom")
        ax.set_xlim(0, x1)
        ax.set_ylim(0, max([bandwidth_tbps or 0.0, *rate, 0.1]) * 1.15)
        ax.set_ylabel("weight bytes issued (TB/s)")
    axes[0].set_title(title, fontsize=10)
    axes[1].set_xlabel("time in the step (us)")
    axes[1].set_title(f"first {layers} layers", fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
