"""Replaying traces: the due-time clock, the in-process driver, the HTTP driver and the command line."""
import argparse
import json
import sys
from pathlib import Path

import pytest

from mimw.bench.main import main as bench_main
from mimw.bench.trace.format import Trace, TraceRequest
from mimw.bench.trace.readers import read_trace
from mimw.bench.trace.remote import check_loopback, replay_http
from mimw.bench.trace.replay import Clock, replay_engine
from mimw.bench.trace.report import step_summary, summarize
from mimw.bench.trace.tokens import TokenSynth
from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.server.main import ByteTokenizer, add_arguments, build

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))  # the server tests' uvicorn helper
from server_helpers import serve_app  # noqa: E402

TRACES = Path(__file__).resolve().parents[3] / "bench" / "traces"
SPEC = get_preset("tiny-llama")


@pytest.fixture(scope="module")
def weights():
    return random_weights(SPEC, seed=0)


def engine(weights, **cfg):
    base = dict(num_pages=48, page_size=8, max_batch=4, max_step_tokens=128)
    base.update(cfg)
    return Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(**base))


def test_the_default_host_tier_is_the_working_set_and_a_quarter_within_half_the_available_memory():
    from mimw.bench.trace.main import default_host_bytes

    assert default_host_bytes(8 << 30, None) == 10 << 30
    assert default_host_bytes(8 << 30, 64 << 30) == 10 << 30
    assert default_host_bytes(70 << 30, 120 << 30) == 60 << 30  # the 8B's long trace on a 128 GB machine


def test_step_summary_buckets_steps_by_tokens():
    st = step_summary([(0.001, 1), (0.003, 1), (0.010, 300), (0.002, 2)])
    assert st["steps"] == 4 and st["tokens_p50"] == 1.5
    assert st["wall_total_s"] == pytest.approx(0.016)
    assert {b: v["steps"] for b, v in st["by_tokens"].items()} == {"1": 2, "2": 1, "512": 1}
    assert st["by_tokens"]["1"]["mean_ms"] == pytest.approx(2.0)
    assert st["by_tokens"]["512"]["share"] == pytest.approx(0.625)
    assert step_summary([]) == {"steps": 0}


def test_clock_releases_requests_as_their_dependencies_finish():
    rs = (TraceRequest(0, "a", 4, 1, (1,), 4, "", (), 0.5), TraceRequest(1, "a", 4, 1, (1,), 4, "", (0,), 2.0),
          TraceRequest(2, "b", 4, 1, (2,), 4, "", (), 0.0), TraceRequest(3, "a", 4, 1, (1,), 4, "", (1, 2), 1.0))
    c = Clock(Trace("t", rs))
    assert c.pop_due(0.1) == [(2, 0.0)] and c.next_due() == 0.5
    assert c.pop_due(1.0) == [(0, 0.5)] and c.next_due() is None
    c.finished(0, 3.0)
    assert c.next_due() == 5.0 and c.pop_due(4.9) == []
    assert c.pop_due(5.0) == [(1, 5.0)]
    c.finished(1, 6.0)
    assert c.next_due() is None  # request 3 still waits for request 2
    c.finished(2, 6.5)
    assert c.pop_due(10.0) == [(3, 7.5)] and not c.done
    c.finished(3, 8.0)
    assert c.done


def test_in_process_replay_serves_every_request_and_never_beats_the_ideal(weights):
    trace = read_trace(TRACES / "agent-tiny.jsonl")
    eng = engine(weights, host_kv_bytes=4 << 20)
    steps: list = []
    outs = replay_engine(eng, trace, TokenSynth(SPEC.vocab_size), max_duration_s=120, steps=steps)
    assert [o.status for o in outs] == ["ok"] * len(trace.requests)
    # the step log: one entry per step the engine ran, its tokens summing to what the engine counted
    assert len(steps) == eng.stats().steps and all(w > 0 and n >= 1 for w, n in steps)
    assert sum(n for _, n in steps) == eng.stats().step_tokens >= sum(o.output_tokens for o in outs)
    assert [o.output_tokens for o in outs] == [r.output_length for r in trace.requests]
    assert all(o.cached_tokens <= o.ideal_tokens for o in outs)
    assert all(o.ttft is not None and o.ttft >= 0 and o.e2e >= o.ttft for o in outs)
    s = summarize(outs)
    assert s["ok"] == len(outs) and s["fraction_of_ideal"] > 0.8 and s["host_hit_rate"] is not None
    assert eng.stats().sessions_live == 0  # every session's last request closed it
    assert eng.stats().pages_in_use == 0


def test_too_long_requests_are_skipped_and_time_runs_out_as_cut(weights):
    trace = read_trace(TRACES / "agent-tiny.jsonl")
    outs = replay_engine(engine(weights, num_pages=24, max_model_len=200), trace, TokenSynth(SPEC.vocab_size))
    assert {o.status for o in outs} <= {"ok", "skipped"} and any(o.status == "skipped" for o in outs)
    outs = replay_engine(engine(weights), trace, TokenSynth(SPEC.vocab_size), max_duration_s=1e-9)
    assert all(o.status == "cut" for o in outs)


def test_http_replay_against_a_served_model(weights, tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    b = build(p.parse_args(["--model", "tiny-llama", "--kv-pages", "48", "--page-size", "8", "--max-batch", "4",
                            "--device", "cpu", "--host-kv-gb", "0.004"]))
    try:
        with serve_app(b.app) as url:
            trace = read_trace(TRACES / "agent-tiny.jsonl")
            outs = replay_http(url, "tiny-llama", trace, TokenSynth(SPEC.vocab_size), max_duration_s=120)
            assert [o.status for o in outs] == ["ok"] * len(trace.requests), [o.error for o in outs]
            assert [o.output_tokens for o in outs] == [r.output_length for r in trace.requests]
            assert sum(o.cached_tokens for o in outs) > 0
            assert b.loop.engine.stats().sessions_live == 0
            out = tmp_path / "http"
            rc = bench_main(["trace", "--trace", str(TRACES / "mooncake-tiny.jsonl"), "--url", url,
                             "--vocab-size", "256", "--out", str(out), "--block-size", "64"])
            assert rc == 0
            doc = json.loads(next(out.glob("*.json")).read_text())
            summary = doc["setups"][0]["summary"]
            assert doc["setups"][0]["name"] == "server" and summary["ok"] == 5
            assert summary["skipped"] == 1  # 420 tokens do not fit this server's 384-token context
            assert summary["host_hit_rate"] is not None  # from /metrics
    finally:
        b.loop.stop()


def test_http_replay_is_loopback_only():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    with pytest.raises(ValueError, match="only a server on this machine"):
        check_loopback("http://10.0.0.1:8000")
    assert bench_main(["trace", "--trace", str(TRACES / "agent-tiny.jsonl"), "--url", "http://example.com"]) == 2


def test_command_line_in_process_writes_json_markdown_and_chart(tmp_path, capsys):
    rc = bench_main(["trace", "--trace", str(TRACES / "agent-tiny.jsonl"), "--model", "tiny-llama", "--device",
                     "cpu", "--setups", "lru,session+host", "--page-size", "8", "--max-batch", "4", "--threads", "1",
                     "--out", str(tmp_path), "--max-requests", "12"])
    assert rc == 0
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".md", ".png"]
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert [s["name"] for s in doc["setups"]] == ["lru", "session+host"]
    assert doc["trace"]["requests"] == 12 and doc["working_set_ratio"] > 1
    assert doc["backend"] == "reference"  # auto, without a Hopper GPU
    for s in doc["setups"]:
        assert s["summary"]["ok"] == 12 and len(s["requests"]) == 12 and s["sessions"]
        st = s["steps"]
        # the engine's count also has the warm-up request's steps
        assert 0 < st["steps"] < s["engine"]["steps"] and st["wall_p50_ms"] > 0 and st["backend_step_ms"]
        assert sum(b["steps"] for b in st["by_tokens"].values()) == st["steps"]
    assert doc["setups"][1]["summary"]["ttft_p50_vs_first"] is not None
    out = capsys.readouterr().out
    assert "session+host" in out and "TTFT p50" in out
    assert "| session+host |" in next(tmp_path.glob("*.md")).read_text()


def test_the_free_backend_replays_the_engine_alone(tmp_path, capsys):
    # a backend that costs nothing: the steps' times are the engine's host work; a preset gives the shape only
    rc = bench_main(["trace", "--trace", str(TRACES / "agent-tiny.jsonl"), "--model", "llama-3.2-1b", "--backend",
                     "free", "--setups", "lru,session+host", "--page-size", "8", "--max-batch", "4",
                     "--out", str(tmp_path), "--max-requests", "12"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["backend"] == "free" and doc["device"].startswith("cpu")
    for s in doc["setups"]:
        assert s["summary"]["ok"] == 12 and s["steps"]["steps"] > 0
    assert doc["setups"][1]["engine"]["host_pages_total"] > 0
    assert "free backend" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--setups", "lru,mru"], ["--page-size", "0"], ["--working-set-ratio", "0"],
                                  ["--backend", "free", "--model", "no/such/dir"]])
def test_command_line_bad_arguments_exit_2(argv, tmp_path):
    base = ["trace", "--trace", str(TRACES / "agent-tiny.jsonl"), "--model", "tiny-llama", "--out", str(tmp_path)]
    assert bench_main(base + argv) == 2
    assert bench_main(["trace", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_trace_gen_writes_a_readable_trace(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert bench_main(["trace-gen", "--out", str(out), "--sessions", "2", "--max-context", "3000",
                       "--system-tokens", "200", "--tool-tokens", "200"]) == 0
    assert read_trace(out).stats()["sessions"] >= 2 and "ideal hit rate" in capsys.readouterr().out
    assert bench_main(["trace-gen", "--out", str(out), "--min-turns", "0"]) == 2
