"""bench/kv_compare.py: bf16 and fp8 records of the same models folded into one table (CPU)."""
import json

from mimw.bench import kv_compare


def _doc(kv, ms, floor):
    return {"config": {"kv_dtype": kv}, "results": [
        {"model": "llama-3.2-1b", "context": 131072, "backend": "mimw-megakernel", "ms_per_step": ms,
         "floor_ms": floor, "ratio_to_floor": ms / floor, "status": "ok"},
        {"model": "llama-3.2-1b", "context": 8192, "backend": "mimw-megakernel", "ms_per_step": None,
         "floor_ms": floor, "ratio_to_floor": None, "status": "error"}]}


def test_rows_pair_the_two_element_types_and_compute_the_speedup(tmp_path, capsys):
    docs = [_doc("bf16", 2.0, 1.5), _doc("fp8", 1.25, 1.0)]
    table = kv_compare.rows(docs)
    assert [r["context"] for r in table] == [8192, 131072]
    long = table[1]
    assert (long["bf16_ms"], long["fp8_ms"], long["fp8_speedup"]) == (2.0, 1.25, 1.6)
    assert long["fp8_x_floor"] == 1.25 and table[0]["fp8_speedup"] is None
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(d))
    assert kv_compare.main([str(f) for f in files] + ["--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "| llama-3.2-1b | 131072 | mimw-megakernel | 2.000 |" in out and "1.60x" in out and "error" in out
    assert json.loads((tmp_path / "t.json").read_text())[1]["fp8_speedup"] == 1.6
    assert kv_compare.main([str(tmp_path / "missing.json")]) == 2
