"""The report of `mimw bench steps` on a synthetic result document: tables (best peer, speedup, errors) and chart."""
from mimw.bench.steps_report import best_peer, markdown, write_chart


def row(kind, segments, block, floor, mimw=None, **extra):
    r = {"model": "llama-3.2-1b", "kind": kind, "segments": segments, "block": block, "context": 1024,
         "tokens": segments * block, "floor_ms": floor, **extra}
    if mimw is not None:
        r["mimw_ms"] = mimw
    return r


DOC = {"gpu": "NVIDIA H100 80GB HBM3", "read_TBps": 3.18, "context": 1024,
       "peers": ["reference", "torch-graph", "torch-compile"],
       "rows": [
           row("decode", 1, 1, 0.8, 1.0, **{"torch-graph_ms": 2.5, "torch-compile_ms": 1.25, "reference_ms": 9.0,
                                            "torch-compile_max_rel_err": 0.004, "torch-compile_argmax_agree": 1.0,
                                            "torch-compile_build_s": 61.2, "torch-compile_notes": "inductor"}),
           row("decode", 8, 1, 0.9, 2.0, replay_ms=8.5, kernel_ms=2.1, batched_ms=2.0, argmax_agree=1.0,
               **{"torch-graph_ms": 3.0, "torch-compile_error": "skipped: --peer-budget-s 100 spent on earlier shapes",
                  "reference_ms": 1.0}),
           row("decode", 64, 1, 1.5, error="RuntimeError: boom", **{"torch-graph_ms": 6.0}),
           row("verify", 1, 4, 0.8, 1.5, kernel_ms=1.5, kernel_argmax_agree=1.0,
               **{"torch-graph_error": "unavailable: no CUDA"}),
           row("verify", 4, 4, 0.82, 1.7, **{"torch-graph_ms": 3.4}),
           row("verify", 1, 16, 0.8, 1.8, **{"torch-graph_ms": 3.6}),
       ]}


def test_best_peer_counts_competitors_only():
    rows = DOC["rows"]
    assert best_peer(rows[0], DOC["peers"]) == ("torch-compile", 1.25)
    assert best_peer(rows[1], DOC["peers"]) == ("torch-graph", 3.0)  # the reference (1.0 ms) is not a competitor
    assert best_peer(rows[3], DOC["peers"]) is None


def test_markdown_has_best_peer_and_speedup_and_keeps_failed_rows():
    md = markdown(DOC)
    lines = md.splitlines()
    assert "| best peer ms | x best peer |" in lines[2]
    assert "| llama-3.2-1b | decode 1x1 | 1 | 0.800 | 1.000 | 1.25 | 1000 | - | - | - | - | 1.250 (torch-compile) " \
           "| 1.25x |" in lines
    assert "| llama-3.2-1b | decode 8x1 | 8 | 0.900 | 2.000 | 2.22 | 4000 | 8.500 | 2.100 | 2.000 | 1.000 | 3.000 " \
           "(torch-graph) | 1.50x |" in lines
    assert any(line.startswith("| llama-3.2-1b | decode 64x1 | 64 | 1.500 | RuntimeError: boom |") for line in lines)
    # a verify block's agreement is its multi-token launch's against one pass
    assert "| llama-3.2-1b | verify 1x4 | 4 | 0.800 | 1.500 | 1.88 | 2667 | - | 1.500 | - | 1.000 | - | - |" in lines
    # the per-peer table: numbers, check, build time, and why a peer is missing
    assert "| llama-3.2-1b | decode 1x1 | torch-compile | 1.250 | 1.56 | 1.25 | 0.0040 | 1.000 | 61.2 | inductor |" \
        in lines
    assert any("decode 8x1 | torch-compile | - |" in line and "peer-budget-s 100 spent" in line for line in lines)
    assert any("verify 1x4 | torch-graph | - |" in line and "unavailable: no CUDA" in line for line in lines)


def test_markdown_without_peers_has_one_table():
    md = markdown({**DOC, "peers": [], "rows": DOC["rows"][:2]})
    assert "Peers" not in md and md.count("| model |") == 1


def test_chart_is_written_as_png(tmp_path):
    path = tmp_path / "steps.png"
    assert write_chart(DOC, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_chart_of_two_models_and_of_nothing(tmp_path):
    other = [{**r, "model": "llama-3.1-8b"} for r in DOC["rows"]]
    assert write_chart({**DOC, "rows": DOC["rows"] + other}, tmp_path / "two.png")
    assert not write_chart({**DOC, "rows": [row("decode", 1, 1, 0.8, error="x")]}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
