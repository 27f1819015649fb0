"""``mimw bench prefill``'s arithmetic and reports: model FLOPs of a prefill, MFU against the in-run GEMM rate,
the markdown table and the chart (TTFT and MFU versus prompt length, one panel per model).

FLOPs of a prefill of n tokens from an empty cache (multiply-adds counted as 2):
  weights    2 n L (D (Q + 2 KV) + Q D + 3 D I)
  attention  4 L Hq hd n (n + 1) / 2      (q.k and p.v for every causal pair)
  LM head    2 D V                         (the last token's logits only)
The roofline TTFT is those FLOPs at the bf16 GEMM rate measured in the same run; MFU = roofline / measured.
"""
from __future__ import annotations

from pathlib import Path

from ..models.spec import ModelSpec


def prefill_flops(spec: ModelSpec, n: int) -> float:
    d, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    weights = 2.0 * n * spec.num_layers * (d * (q + 2 * kv) + q * d + 3 * d * i)
    attention = 4.0 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) / 2
    return weights + attention + 2.0 * d * spec.vocab_size


def finish_row(row: dict, spec: ModelSpec, gemm_tflops: float) -> dict:
    """Adds FLOPs, roofline, tokens/s and MFU to a row with ``ttft_s``."""
    f = prefill_flops(spec, row["tokens"])
    row["flops"] = f
    row["roofline_s"] = f / (gemm_tflops * 1e12)
    if row.get("ttft_s"):
        row["tokens_per_s"] = row["tokens"] / row["ttft_s"]
        row["mfu"] = row["roofline_s"] / row["ttft_s"]
    return row


def _mfu(r: dict) -> str:
    """A row's MFU as a percentage; blank for no-attention, whose time lacks the attention its FLOPs count."""
    return "" if r["impl"] == "no-attention" else f"{100 * r['mfu']:.1f}%"


def markdown(doc: dict) -> str:
    head = (f"# mimw bench prefill — {doc['gpu']} — {doc['date']}\n\ncommit {doc['commit']}, torch {doc['torch']}, "
            f"triton {doc['triton']}; bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s (8192^3, this run)\n")
    lines = [head, "| model | tokens | impl | chunk | TTFT s | tok/s | MFU | vs plain SDPA | peak GB | check |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    plain = {(r["model"], r["tokens"]): r["ttft_s"] for r in doc["rows"]
             if r["impl"] == "plain-sdpa" and r.get("ttft_s")}
    for r in sorted(doc["rows"], key=lambda r: (r["model"], r["tokens"], r["impl"] != "plain-sdpa", r["impl"])):
        if not r.get("ttft_s"):
            lines.append(f"| {r['model']} | {r['tokens']} | {r['impl']} | {r.get('chunk', '')} | "
                         f"{r.get('error', 'not run')} | | | | | |")
            continue
        base = plain.get((r["model"], r["tokens"]))
        speed = f"{base / r['ttft_s']:.2f}x" if base and r["impl"] != "plain-sdpa" else ""
        check = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['impl']} | {r.get('chunk', '')} | {r['ttft_s']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {_mfu(r)} | {speed} | {r.get('peak_gb', 0):.1f} | "
                     f"{check} |")
    if doc.get("attention"):
        lines += ["", "Attention alone (one layer, the last pass of a prompt of `tokens`, TFLOP/s; the output's "
                  "largest difference from the paged Triton kernel's, relative to its largest value):", "",
                  "| model | tokens | impl | tiles | ms | TFLOP/s | vs triton |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
        for a in doc["attention"]:
            err = f"{a['err_vs_triton']:.1e}" if a.get("err_vs_triton") is not None else ""
            lines.append(f"| {a['model']} | {a['tokens']} | {a['impl']} | {a.get('tiles', '')} | "
                         + (f"{a['ms']:.3f} | {a['tflops']:.0f} | {err} |" if a.get("ms")
                            else f"{a.get('error')} | | |"))
    return "\n".join(lines) + "\n"


def write_chart(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r.get("ttft_s") and "@" not in r["impl"]]
    models = sorted({r["model"] for r in rows})
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for impl in sorted({r["impl"] for r in mine}):
            pts = sorted((r["tokens"], r["ttft_s"], r["mfu"]) for r in mine if r["impl"] == impl)
            style = dict(marker="o", linestyle="--" if impl == "plain-sdpa" else "-")
            axes[0, col].plot([p[0] for p in pts], [p[1] for p in pts], label=impl, **style)
            axes[1, col].plot([p[0] for p in pts], [100 * p[2] for p in pts], label=impl, **style)
        roof = sorted({(r["tokens"], r["roofline_s"]) for r in mine})
        axes[0, col].plot([p[0] for p in roof], [p[1] for p in roof], color="k", linestyle=":",
                          label="roofline (in-run GEMM rate)")
        axes[0, col].set(xscale="log", yscale="log", title=f"{model}: time to first token", xlabel="prompt tokens",
                         ylabel="seconds")
        axes[1, col].set(xscale="log", title=f"{model}: MFU", xlabel="prompt tokens", ylabel="% of bf16 GEMM rate")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"mimw prefill — {doc['gpu']} — {doc['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(doc: dict) -> str:
    """The short table: per model and length, each implementation's TTFT and MFU beside plain SDPA's."""
    rows = [r for r in doc["rows"] if "@" not in r["impl"]]
    order = ("triton", "gluon", "cudnn", "sdpa", "flex", "engine-triton", "no-attention", "plain-sdpa")
    impls = [i for i in order if any(r["impl"] == i for r in rows)]
    out = ["model         tokens  " + "  ".join(f"{i:>18}" for i in impls) + "   (TTFT s / MFU)"]
    for model in sorted({r["model"] for r in rows}):
        for n in sorted({r["tokens"] for r in rows if r["model"] == model and r["tokens"]}):
            cells = []
            for i in impls:
                r = next((r for r in rows if r["model"] == model and r["tokens"] == n and r["impl"] == i), None)
                if r is None or not r.get("ttft_s"):
                    cells.append(f"{'-' if r is None else r.get('error', '?')[:18]:>18}")
                else:
                    cells.append(f"{r['ttft_s']:>9.4f} {_mfu(r):>7} ")
            out.append(f"{model[:13]:13s} {n:>6}  " + "  ".join(cells))
    return "\n".join(out)
