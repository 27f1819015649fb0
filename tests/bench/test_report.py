"""Reports from synthetic timings: derived figures, best-peer speedups, JSON shape, markdown, chart, README table."""
import json

import pytest

from mimw.bench.chart import write_chart
from mimw.bench.readme import END, START, latest_runs, update_readme
from mimw.bench.report import finalize_rows, markdown, record, write_json

GB = 1_000_000_000


def _raw(backend, ms, status="ok", context=1024, nbytes=2 * GB, rel=1e-3):
    check = None if status in ("unavailable", "error", "unchecked") else {
        "ok": status == "ok", "rel_err": rel, "argmax": 1, "ref_argmax": 1,
        "detail": "ok" if status == "ok" else "argmax 1 != reference 2"}
    return {"event": "result", "model": "llama-3.2-1b", "context": context, "backend": backend, "status": status,
            "ms_per_step": ms, "bytes_per_step": nbytes, "timing": None, "check": check, "notes": "n",
            "error": "No module named x" if status == "unavailable" else None, "t": 0.0}


RAW = [_raw("mimw-megakernel", 0.5), _raw("mimw-reference", 20.0), _raw("torch-eager", 4.0),
       _raw("torch-compile-reduce-overhead", 1.0), _raw("torch-compile-max-autotune", 0.8, status="check-failed"),
       _raw("hf-transformers", None, status="unavailable"), _raw("torch-eager", 6.0, context=8192, nbytes=3 * GB),
       _raw("mimw-megakernel", 1.5, status="unchecked", context=8192, nbytes=3 * GB)]


def _doc():
    meta = {"gpu": "NVIDIA H200", "commit": "abc", "torch": "2.11", "triton": "3.6.0", "transformers": "5.17",
            "read_TBps": 4.0, "date": "2026-12-02 15:00 UTC", "model": "llama-3.2-1b", "config": {"dtype": "bfloat16"}}
    return record(meta, finalize_rows(RAW, 4e12))


def test_derived_figures_and_speedups():
    rows = {(r["context"], r["backend"]): r for r in _doc()["results"]}
    mk = rows[(1024, "mimw-megakernel")]
    assert mk["floor_ms"] == pytest.approx(0.5)              # 2 GB / 4 TB/s
    assert mk["ratio_to_floor"] == pytest.approx(1.0) and mk["TBps"] == pytest.approx(4.0)
    assert mk["tokens_per_s"] == pytest.approx(2000.0)
    # best peer: compile-reduce-overhead at 1.0 ms; the faster max-autotune failed its check, mimw rows never count
    assert mk["best_peer"] == "torch-compile-reduce-overhead" and mk["speedup_vs_best_peer"] == pytest.approx(2.0)
    assert rows[(1024, "torch-eager")]["speedup_vs_best_peer"] == pytest.approx(0.25)
    hf = rows[(1024, "hf-transformers")]
    assert hf["ms_per_step"] is None and hf["ratio_to_floor"] is None and hf["speedup_vs_best_peer"] is None
    assert rows[(8192, "mimw-megakernel")]["speedup_vs_best_peer"] == pytest.approx(4.0)  # vs torch-eager 6 ms
    assert rows[(8192, "mimw-megakernel")]["floor_ms"] == pytest.approx(0.75)


def test_json_shape(tmp_path):
    doc = _doc()
    p = tmp_path / "r.json"
    write_json(p, doc)
    back = json.loads(p.read_text())
    for key, typ in {"gpu": str, "commit": str, "torch": str, "triton": str, "read_TBps": float}.items():
        assert isinstance(back[key], typ)
    for r in back["results"]:
        assert {"model", "context", "backend", "ms_per_step", "tokens_per_s", "TBps", "floor_ms",
                "ratio_to_floor", "status", "check", "speedup_vs_best_peer"} <= set(r)
        assert "event" not in r and "t" not in r
        if r["status"] == "ok":
            assert all(isinstance(r[k], float) for k in ("ms_per_step", "tokens_per_s", "TBps", "floor_ms",
                                                          "ratio_to_floor"))
    assert not list(tmp_path.glob("*.tmp"))


def test_markdown_marks_failures():
    md = markdown(_doc())
    assert "NVIDIA H200" in md and "4.00 TB/s" in md and "bfloat16" in md
    assert "| 1024 | **floor** | 0.500 |" in md
    assert "torch-compile-max-autotune (✗ check)" in md and "✗ FAILED" in md
    assert "unavailable: No module named x" in md
    assert "| 1024 | mimw-megakernel | 0.500 | 2000 | 4.00 | 1.00 | 2.00x | ✓ 1.0e-03 |" in md
    assert "unchecked" in md


def test_chart_writes_png(tmp_path):
    p = tmp_path / "c.png"
    write_chart(_doc(), p)
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_table_uses_latest_run(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    old, new = _doc(), _doc()
    old["date"] = "2026-12-01 10:00 UTC"
    old["results"][0]["ms_per_step"] = 99.0
    write_json(results / "a-old.json", old)
    write_json(results / "b-new.json", new)
    (results / "junk.json").write_text("{not json")
    partial = _doc()  # newer still, but only context 8192: context 1024 keeps b-new's run
    partial["date"] = "2026-12-03 10:00 UTC"
    partial["results"] = [r for r in partial["results"] if r["context"] == 8192]
    partial["results"][0]["ms_per_step"] = 5.5
    write_json(results / "c-partial.json", partial)
    runs = latest_runs(results)
    assert [(p.name, c) for p, _, c in runs] == [("b-new.json", 1024), ("c-partial.json", 8192)]
    readme = tmp_path / "README.md"
    readme.write_text(f"# Bench\n\nmethod notes\n\n{START}\nstale\n{END}\n\ntail\n")
    text = update_readme(readme, results)
    assert "method notes" in text and "tail" in text and "stale" not in text
    assert "| llama-3.2-1b | 1024 | mimw-megakernel | 0.500 |" in text and "99.000" not in text
    assert "*floor*" in text and "hf-transformers" not in text  # untimed rows are left out
    assert "| llama-3.2-1b | 8192 | torch-eager | 5.500 |" in text and "6.000" not in text
    fresh = tmp_path / "NEW.md"
    assert START in update_readme(fresh, tmp_path / "empty")
