"""bf16 against fp8 KV side by side: one table from the JSON records of ``mimw bench decode`` runs of the same
models at ``--kv-dtype bf16`` and ``--kv-dtype fp8`` (``scripts/fp8_gpu.sh`` runs both, then this).

    python -m mimw.bench.kv_compare RESULTS.json [...]      # prints the markdown table; --json FILE writes the rows

A row per (model, context, backend) measured at both element types: each one's ms per step, floor (weights plus
the KV bytes its cache holds: ``mimw.bench.floor``, scales included for fp8) and ratio to it, and the speedup of
fp8 over bf16. Pure functions over the records; nothing is measured here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Sequence


def rows(docs: Iterable[dict]) -> list[dict]:
    """Records (report.record's documents) -> one row per (model, context, backend) with both element types."""
    by: dict[tuple[str, int, str], dict[str, dict]] = {}
    for doc in docs:
        kv = (doc.get("config") or {}).get("kv_dtype", "bf16")
        for r in doc.get("results", []):
            by.setdefault((r["model"], r["context"], r["backend"]), {})[kv] = r
    out = []
    for (model, ctx, backend), kinds in sorted(by.items()):
        row = {"model": model, "context": ctx, "backend": backend}
        for kv in ("bf16", "fp8"):
            r = kinds.get(kv) or {}
            row[f"{kv}_ms"], row[f"{kv}_floor_ms"] = r.get("ms_per_step"), r.get("floor_ms")
            row[f"{kv}_x_floor"], row[f"{kv}_status"] = r.get("ratio_to_floor"), r.get("status")
        b, f = row["bf16_ms"], row["fp8_ms"]
        row["fp8_speedup"] = b / f if b and f else None
        out.append(row)
    return out


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def markdown(table: Sequence[dict]) -> str:
    lines = ["| model | context | backend | bf16 ms | bf16 floor | bf16 × floor | fp8 ms | fp8 floor | fp8 × floor "
             "| fp8 speedup |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in table:
        cells = [r["model"], str(r["context"]), r["backend"]]
        for kv in ("bf16", "fp8"):
            ms = _f(r[f"{kv}_ms"], ".3f") or (r[f"{kv}_status"] or "-")
            cells += [ms, _f(r[f"{kv}_floor_ms"], ".3f"), _f(r[f"{kv}_x_floor"], ".2f")]
        cells.append(_f(r["fp8_speedup"], ".2f") + ("x" if r["fp8_speedup"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.kv_compare", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="RESULTS.json")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    try:
        docs = [json.loads(Path(f).read_text()) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"kv_compare: error: {e}", file=sys.stderr)
        return 2
    table = rows(docs)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
