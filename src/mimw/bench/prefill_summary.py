"""The end of ``scripts/prefill_gpu.sh``: the newest ``*-prefill.json`` of a directory as the few lines a reader
needs: attention alone (TFLOP/s per implementation), which attention wins (the rule below), and the TTFT/MFU table.

The rule that picks the default attention (``PrefillConfig.attention``) and deletes the others: over the long-prompt
cells (every model at every length >= 32k that has a plain SDPA row), each attention's TTFT relative to the plain
SDPA prefill of the same run. Only attentions that ran every cell compete; the best geometric mean of those ratios
wins, except that triton stays the default while its geomean is within 2% of the best (a tie goes to the project's
own paged kernel, which also serves the short steps the megakernel backend captures in CUDA graphs: they need
its fixed grid). An attention that is neither the default nor within 2% of the fastest in some cell loses.

    python -m mimw.bench.prefill_summary DIR
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .prefill_report import summary

ATTENTIONS = ("triton", "gluon", "cudnn", "sdpa", "flex")
LONG = 32768
TIE = 1.02  # geomeans or cell times within 2% of each other are a tie


def verdict(doc: dict) -> str:
    rows = [r for r in doc["rows"] if r.get("ttft_s") and "@" not in r["impl"]]
    plain = {(r["model"], r["tokens"]): r["ttft_s"] for r in rows if r["impl"] == "plain-sdpa" and r["tokens"] >= LONG}
    ratio = {}  # (impl, cell) -> TTFT / plain SDPA's
    for r in rows:
        cell = (r["model"], r["tokens"])
        if r["impl"] in ATTENTIONS and cell in plain:
            ratio[r["impl"], cell] = r["ttft_s"] / plain[cell]
    if not plain:
        return "verdict: no long-prompt cell with a plain SDPA row"
    cells = sorted(plain)
    complete = [i for i in ATTENTIONS if all((i, c) in ratio for c in cells)]
    lines = [f"verdict over {len(cells)} cells ({', '.join(f'{m} {n}' for m, n in cells)}), TTFT / plain SDPA:"]
    gm = {}
    for i in ATTENTIONS:
        have = [ratio[i, c] for c in cells if (i, c) in ratio]
        if have:
            g = math.exp(sum(map(math.log, have)) / len(have))
            if i in complete:
                gm[i] = g
            cell_text = " ".join(f"{ratio[i, c]:.3f}" if (i, c) in ratio else "-" for c in cells)
            lines.append(f"  {i:<7} {cell_text}   geomean {g:.3f}{'' if i in complete else ' (incomplete)'}")
    if not gm:
        return "\n".join(lines + ["  no attention ran every cell"])
    best = min(gm, key=gm.get)
    win = "triton" if "triton" in gm and gm["triton"] <= TIE * gm[best] else best
    if win != best:
        lines.append(f"  best geomean: {best} ({gm[best]:.3f}); triton's ({gm['triton']:.3f}) is within 2% of it: "
                     "the tie goes to triton")
    fastest = {c: min(ratio[j, c] for j in ATTENTIONS if (j, c) in ratio) for c in cells}
    keep = {win} | {i for c in cells for i in ATTENTIONS if (i, c) in ratio and ratio[i, c] <= TIE * fastest[c]}
    lines.append(f"  default: {win} (geomean {gm[win]:.3f}; {'beats' if gm[win] < 1 else 'loses to'} plain SDPA)")
    lines.append(f"  keep: {', '.join(sorted(keep))}; delete: "
                 + (", ".join(i for i in ATTENTIONS if any(k[0] == i for k in ratio) and i not in keep) or "none"))
    return "\n".join(lines)


def attention_lines(doc: dict) -> list[str]:
    cells: dict[tuple, list[str]] = {}
    for a in doc.get("attention", []):
        if a.get("tflops"):
            err = f" (err {a['err_vs_triton']:.0e})" if a.get("err_vs_triton") is not None else ""
            text = f"{a['impl']}{a.get('tiles') or ''} {a['tflops']:.0f}{err}"
            cells.setdefault((a["model"], a["tokens"]), []).append(text)
    return [f"attention alone, {m} {n} (last pass), TFLOP/s: " + "; ".join(c) for (m, n), c in cells.items()]


def main(argv: list[str]) -> int:
    runs = sorted(Path(argv[0]).glob("*-prefill.json")) if argv else []
    if not runs:
        print("no bench JSON: see prefill-bench.log", file=sys.stderr)
        return 1
    doc = json.loads(runs[-1].read_text())
    for line in attention_lines(doc):
        print(line)
    print(f"bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s on {doc['gpu']}")
    print(verdict(doc))
    print(summary(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
