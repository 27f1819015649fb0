"""Regenerate bench/README.md's table of latest numbers from the JSON files in bench/results/.

``python -m mimw.bench.readme [--results DIR] [--readme PATH]``. For every model and context the most recent run
(by its ``date`` field, then file name) is taken; rows without a timing are left out. The table replaces whatever lies
between the two marker comments in the README; the rest of the file (the hand-written method notes) is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def latest_runs(results_dir: Path) -> list[tuple[Path, dict, int]]:
    """The newest JSON document per model and context in ``results_dir``, as (path, document, context), sorted by
    model then context: a run that measured only some contexts replaces those and keeps the others' older run
    (unreadable files are skipped with a warning)."""
    best: dict[tuple[str, int], tuple[tuple[str, str], Path, dict]] = {}
    for p in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"mimw.bench.readme: skipping {p}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict) or "results" not in doc:
            continue
        key = (str(doc.get("date", "")), p.name)
        for model, context in {(model_key(doc, r.get("model") or doc.get("model") or p.stem), r["context"])
                               for r in doc["results"] if r.get("ms_per_step")}:
            if (model, context) not in best or key > best[(model, context)][0]:
                best[(model, context)] = (key, p, doc)
    return [(p, doc, mc[1]) for mc, (_, p, doc) in sorted(best.items())]


def model_key(doc: dict, model: str) -> str:
    """The model's name, marked with its KV element type when that is not bf16 (their rows never replace bf16's)."""
    kv = (doc.get("config") or {}).get("kv_dtype", "bf16")
    return model if kv == "bf16" else f"{model} ({kv} KV)"


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def table(runs: list[tuple[Path, dict, int]], link_dir: str = "results") -> str:
    if not runs:
        return "_No results yet: run the command above, then `python -m mimw.bench.readme`._"
    lines = ["| model | context | backend | ms/step | tokens/s | × floor | vs best peer | check | GPU, date, commit |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for p, doc, c in runs:
        where = (f"{doc.get('gpu', '?')}, {doc.get('date', '?')}, `{str(doc.get('commit', '?'))[:7]}` "
                 f"([json]({link_dir}/{p.name}))")
        rows = sorted((r for r in doc["results"] if r.get("ms_per_step") and r["context"] == c),
                      key=lambda r: r["ms_per_step"])
        for r in rows:
            ok = {"ok": "✓", "unchecked": "unchecked"}.get(r["status"], "✗ " + r["status"])
            sp = r.get("speedup_vs_best_peer")
            lines.append(f"| {model_key(doc, r['model'])} | {r['context']} | {r['backend']} | {r['ms_per_step']:.3f} | "
                         f"{_f(r.get('tokens_per_s'), '.0f')} | {_f(r.get('ratio_to_floor'), '.2f')} | "
                         f"{'' if sp is None else f'{sp:.2f}x'} | {ok} | {where} |")
        fl = next((r["floor_ms"] for r in doc["results"] if r["context"] == c and r.get("floor_ms")), None)
        if fl:
            lines.append(f"| {model_key(doc, rows[0]['model'])} | {c} | *floor* ({_f(doc.get('read_TBps'), '.2f')} "
                         f"TB/s) | {fl:.3f} | {1e3 / fl:.0f} | 1.00 | | | {where} |")
    return "\n".join(lines)


def update_readme(readme: Path, results_dir: Path) -> str:
    """Rewrite the marked section of ``readme`` (appending the markers if absent); returns the new text."""
    text = readme.read_text() if readme.exists() else "# mimw benchmarks\n"
    link_dir = os.path.relpath(results_dir, readme.parent)
    block = f"{START}\n{table(latest_runs(results_dir), link_dir)}\n{END}"
    if START in text and END in text and text.index(START) < text.index(END):
        new = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        new = text.rstrip("\n") + "\n\n## Latest numbers\n\n" + block + "\n"
    readme.write_text(new)
    return new


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.readme", description=__doc__.splitlines()[0])
    p.add_argument("--results", default="bench/results", type=Path)
    p.add_argument("--readme", default="bench/README.md", type=Path)
    a = p.parse_args(argv)
    update_readme(a.readme, a.results)
    print(f"updated {a.readme} from {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
