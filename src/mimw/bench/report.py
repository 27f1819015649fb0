"""Results of a run: per-row derived figures, the JSON record and the markdown table (pure functions).

A row's compulsory traffic ``bytes_per_step`` (weights + KV at its context, ``mimw.bench.floor``) turns a median
step time into tokens/s, achieved TB/s and the ratio to the floor. ``speedup_vs_best_peer`` compares each row with
the fastest *peer* (a backend without the ``mimw`` prefix) at the same model and context that passed its
correctness check: a peer that failed the check, or could not be checked, never sets the bar.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from .floor import achieved_tbps, floor_ms, tokens_per_s
from .peers import is_mimw

STATUSES = ("ok", "check-failed", "unchecked", "unavailable", "error", "timeout")


def finalize_rows(raw: Iterable[dict], read_bytes_per_s: float) -> list[dict]:
    """Result events -> report rows with the derived figures (None where a row has no timing)."""
    rows = []
    for r in raw:
        row = {k: v for k, v in r.items() if k not in ("event", "t")}
        ms, nbytes = row.get("ms_per_step"), row.get("bytes_per_step")
        fl = floor_ms(nbytes, read_bytes_per_s) if nbytes else None
        row["floor_ms"] = fl
        row["tokens_per_s"] = tokens_per_s(ms) if ms else None
        row["TBps"] = achieved_tbps(nbytes, ms) if ms and nbytes else None
        row["ratio_to_floor"] = ms / fl if ms and fl else None
        rows.append(row)
    best: dict[tuple[str, int], tuple[float, str]] = {}
    for row in rows:
        if not is_mimw(row["backend"]) and row["status"] == "ok" and row["ms_per_step"]:
            key = (row["model"], row["context"])
            if key not in best or row["ms_per_step"] < best[key][0]:
                best[key] = (row["ms_per_step"], row["backend"])
    for row in rows:
        b = best.get((row["model"], row["context"]))
        row["best_peer"] = b[1] if b else None
        row["speedup_vs_best_peer"] = b[0] / row["ms_per_step"] if b and row["ms_per_step"] else None
    return rows


def record(meta: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """The JSON document of one model's run: ``meta`` (gpu, commit, torch, triton, read_TBps, ...) + results."""
    return {**meta, "results": rows}


def write_json(path: Path, doc: dict) -> None:
    """Atomic write (a reader or a kill mid-write never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def publish(out_dir: str | Path, filename: str, doc: dict, table: str) -> Path:
    """A bench's JSON document into ``out_dir``/``filename`` (atomic), its table and the path on stdout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    write_json(path, doc)
    print(table)
    print(f"wrote {path}")
    return path


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def check_cell(row: dict) -> str:
    c = row.get("check")
    if row["status"] == "unchecked":
        return "unchecked"
    if c is None:
        return ""
    # an MoE row judged without the backend's own routing says so
    enumerated = " (enumerated routings: no own routing)" if c.get("routing_source") == "enumerated" else ""
    if c["ok"]:
        if c.get("routing_source") == "own":  # "ok (own routing; 2 near-ties)"
            return f"✓ {c['rel_err']:.1e} " + c["detail"].removeprefix("ok ")
        tie = " (routing near-tie)" if "routing near-tie" in c["detail"] else (
            " (near-tie)" if "near-tie" in c["detail"] else "")
        return f"✓ {c['rel_err']:.1e}" + tie + enumerated
    return f"✗ FAILED: {c['detail']}" + enumerated


def markdown(doc: dict) -> str:
    rows = doc["results"]
    models = sorted({r["model"] for r in rows}) or [doc.get("model", "?")]
    dtype = (doc.get("config") or {}).get("dtype", "bfloat16")
    kv = (doc.get("config") or {}).get("kv_dtype", "bf16")
    dtype += f", {kv} KV" if kv != "bf16" else ""
    lines = [f"# Decode step, batch 1, {dtype}: {', '.join(models)} on {doc.get('gpu', '?')}", "",
             f"{doc.get('date', '?')} · commit `{doc.get('commit', 'unknown')}` · torch {doc.get('torch', '?')} · "
             f"triton {doc.get('triton', '?')} · transformers {doc.get('transformers', '?')} · "
             f"streaming read **{_f(doc.get('read_TBps'), '.2f')} TB/s** (the floor's denominator)", "",
             "| context | backend | ms/step | tokens/s | TB/s | × floor | speedup vs best peer | check | notes |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for ctx in sorted({r["context"] for r in rows}):
        group = [r for r in rows if r["context"] == ctx]
        fl = next((r["floor_ms"] for r in group if r.get("floor_ms")), None)
        nb = next((r["bytes_per_step"] for r in group if r.get("bytes_per_step")), None)
        chk = next((r["check"] for r in group if r.get("check")), None)
        enum = next((r["check"] for r in group if (r.get("check") or {}).get("routings")), None)
        tol = "" if chk is None else f"check: rel_err ≤ {chk.get('rel_tol', 2e-2):.1e}" + (
            "" if chk.get("bf16_noise") is None else f" (bf16 vs fp32 reference: {chk['bf16_noise']:.1e})") + (
            "" if chk.get("route_tie") is None else f"; MoE: against the reference on the backend's own routing, "
            f"each layer's experts within the near-tie bound {chk['route_tie']:.1e}") + (
            "" if enum is None else f"; a backend without one: against {enum['routings']} enumerated routing(s)"
            + (" (capped)" if enum.get("routes_capped") else ""))
        if fl is not None:
            lines.append(f"| {ctx} | **floor** | {fl:.3f} | {1e3 / fl:.0f} | {_f(doc.get('read_TBps'), '.2f')} | 1.00 "
                         f"| | {tol} | {nb / 1e6:.1f} MB read per step |")
        for r in group:
            if r["ms_per_step"] is None:
                msg = f"{r['status']}: {r.get('error') or ''}".replace("|", "/")
                lines.append(f"| {ctx} | {r['backend']} | {msg} | | | | | {check_cell(r)} | |")
                continue
            sp = r.get("speedup_vs_best_peer")
            name = r["backend"] if r["status"] in ("ok", "unchecked") else f"{r['backend']} (✗ check)"
            lines.append(f"| {ctx} | {name} | {r['ms_per_step']:.3f} | {_f(r['tokens_per_s'], '.0f')} | "
                         f"{_f(r['TBps'], '.2f')} | {_f(r['ratio_to_floor'], '.2f')} | "
                         f"{'' if sp is None else f'{sp:.2f}x'} | {check_cell(r)} | {r.get('notes', '')} |")
    lines += ["", "ms/step: median of per-step CUDA-event times (graph replays where the backend uses graphs). "
              "× floor: ms/step over (weights + KV bytes) / streaming read. Speedup: best passing peer's ms over "
              "this row's ms.", ""]
    return "\n".join(lines)
