"""``mimw bench overlap`` on the CPU with the tiny preset: one short run writes its table and JSON; bad options
are one-line errors."""
import json

from mimw.bench.overlap import main


def test_a_short_cpu_run_writes_rows_for_both_modes(tmp_path, capsys):
    assert main(["--model", "tiny-llama", "--batches", "1,2", "--tokens", "10", "--prompt", "5", "--step-iters", "3",
                 "--threads", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("overlap-*-tiny-llama.json")).read_text())
    assert doc["backend"] == "reference" and [r["batch"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        assert r["backend_step_ms"] > 0 and r["engine_host_ms"]["sync"] > 0 and r["engine_host_ms"]["overlap"] > 0
        for mode in ("sync", "overlap"):
            assert r[mode]["itl_ms"] > 0 and r[mode]["tokens"] == r["batch"] * 10
            m = r[mode]  # the token gaps' spread: the median and p90 within the longest, stalls a share
            assert 0 < m["itl_p50_ms"] <= m["itl_p90_ms"] <= m["itl_max_ms"] and 0 <= m["stall_share"] < 1
            g = r[mode]["gc"]  # the collector's pauses in the measure
            assert g["pauses"] >= 0 and g["ms"] >= g["max_ms"] >= 0
    out = capsys.readouterr()
    assert "| batch |" in out.out and "gc pauses: sync" in out.err and "in stalls" in out.err


def test_bad_options_are_one_line_errors(capsys):
    assert main(["--batches", "0"]) == 2
    assert main(["--model", "no-such-preset", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("mimw bench overlap: error:") == 2 and "Traceback" not in err


def test_profile_writes_a_trace_per_mode_and_prints_the_host_calls(tmp_path, capsys):
    assert main(["--model", "tiny-llama", "--batches", "2", "--tokens", "8", "--prompt", "4", "--step-iters", "2",
                 "--threads", "1", "--profile", "--out", str(tmp_path)]) == 0
    traces = sorted(p.name for p in tmp_path.glob("profile-*.json"))
    assert traces == ["profile-overlap-b2.json", "profile-sync-b2.json"]
    assert all(json.loads((tmp_path / t).read_text())["traceEvents"] for t in traces)
    err = capsys.readouterr().err
    assert "profile sync, batch 2" in err and "profile overlap, batch 2" in err and "Self CPU" in err


def test_graph_work_counts_captures_eager_steps_host_waits_and_steps_by_path():
    """The megakernel backend's step graphs and decoders as plain objects: the pinned-buffer waits of every graph's
    inputs and of every decoder's step state (the one-token decoder and its batch decoders) add up."""
    from types import SimpleNamespace as NS

    from mimw.bench.overlap import graph_work

    ring = lambda n: NS(ring=NS(stalls=n))  # noqa: E731
    graphs = NS(patterns=NS(captures=3, eager=5, graphs={"a": NS(inputs=ring(1)), "b": NS(inputs=ring(2))}))
    dec = NS(state=NS(inputs=ring(4)), graph=object(),
             _batches={(8, ()): NS(state=NS(inputs=ring(8)), graph=None)})  # the batch decoder not captured yet
    got = {"captures": 3, "eager": 5, "pinned_waits": 15, "kernel_decoders": 2, "kernel_graphs": 1}
    assert graph_work(NS(_graphs=graphs, _dec=dec)) == got
    paths = {"batched": 120, "prefill": 2}
    assert graph_work(NS(_graphs=graphs, _dec=dec, steps_by_path=paths)) == {
        **got, "path_batched": 120, "path_prefill": 2}
    none = graph_work(NS(_graphs=graphs, _dec=None))
    assert none["pinned_waits"] == 3 and none["kernel_decoders"] == none["kernel_graphs"] == 0
    assert graph_work(NS()) == {}
