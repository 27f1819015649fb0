"""The run end to end on the CPU (in-process), the supervisor's crash/hang handling with a fake worker, and the
command line's refusal without CUDA."""
import json
import sys
import textwrap

import pytest
import torch

from mimw.bench import main as bench_main
from mimw.bench.bandwidth import ReadBandwidth
from mimw.bench.config import DecodeBenchConfig, parse_contexts
from mimw.bench.supervisor import run_model


def test_run_decode_in_process_writes_reports(tmp_path):
    cfg = DecodeBenchConfig(models=("tiny-qwen2",), contexts=(3, 17),
                            backends=("mimw-megakernel", "mimw-reference", "torch-eager", "torch-eager-graph"),
                            out_dir=str(tmp_path), iters=3, warmup=1, budget_s=0.05, dtype="float32", device="cpu",
                            in_process=True)
    rc = bench_main.run_decode(cfg, "Fake GPU", lambda: ReadBandwidth(1e11, 1 << 30, "fake", 9e10), commit="c0ffee")
    assert rc == 0
    [j] = tmp_path.glob("*-fake-gpu-tiny-qwen2.json")
    assert j.with_suffix(".md").exists() and j.with_suffix(".png").exists()
    doc = json.loads(j.read_text())
    assert doc["commit"] == "c0ffee" and doc["gpu"] == "Fake GPU" and doc["read_TBps"] == pytest.approx(0.1) and doc["spec"]["arch"] == "qwen2"
    status = {(r["context"], r["backend"]): r["status"] for r in doc["results"]}
    assert len(status) == 8
    for c in (3, 17):
        assert status[(c, "mimw-reference")] == "ok" and status[(c, "torch-eager")] == "ok"
        assert status[(c, "torch-eager-graph")] == "unavailable"
        assert status[(c, "mimw-megakernel")] in ("unavailable", "error", "ok", "unchecked", "check-failed")
    eager = next(r for r in doc["results"] if r["backend"] == "torch-eager" and r["context"] == 17)
    assert eager["check"]["ok"] and eager["ms_per_step"] > 0 and eager["speedup_vs_best_peer"] == pytest.approx(1.0)


def test_an_moe_run_floors_each_step_at_its_routed_experts(tmp_path):
    from mimw.bench.floor import routed_experts, step_bytes
    from mimw.bench.fused import random_bench_weights
    from mimw.bench.inputs import decode_inputs, reference_logits
    from mimw.models.spec import get_preset

    cfg = DecodeBenchConfig(models=("tiny-qwen3-moe",), contexts=(5,),
                            backends=("mimw-megakernel", "mimw-reference", "torch-eager", "hf-transformers"),
                            out_dir=str(tmp_path), iters=3, warmup=1, budget_s=0.05, dtype="float32", device="cpu",
                            in_process=True)
    rc = bench_main.run_decode(cfg, "Fake GPU", lambda: ReadBandwidth(1e11, 1 << 30, "fake", 9e10), commit="c0ffee")
    assert rc == 0
    [j] = tmp_path.glob("*-fake-gpu-tiny-qwen3-moe.json")
    rows = {r["backend"]: r for r in json.loads(j.read_text())["results"]}
    assert rows["mimw-reference"]["status"] == "ok"
    # the fused PyTorch peer's MoE block (gpt-fast's recipe) against the reference's logits
    assert rows["torch-eager"]["status"] == "ok" and rows["torch-eager"]["check"]["rel_err"] < 2e-2
    assert {rows[b]["status"] for b in ("mimw-megakernel", "hf-transformers")} == {"unavailable"}
    # the floor's bytes: the experts the reference routed the benchmark's step to, not all of them
    spec = get_preset("tiny-qwen3-moe")
    bw = random_bench_weights(spec, seed=0, dtype=torch.float32, device="cpu")
    routings = []
    reference_logits(bw.weights, decode_inputs(spec, 5, dtype=torch.float32, device="cpu"), routings)
    assert routed_experts(routings) == 2 * spec.num_experts_per_tok  # one token: k distinct experts a layer
    assert rows["mimw-reference"]["bytes_per_step"] == step_bytes(spec, 5, routed_experts=8) < \
        spec.decode_weight_bytes()


FAKE_WORKER = textwrap.dedent('''
    import json, sys, time
    cfg, model, tasks, events = sys.argv[1:]
    def emit(ev):
        with open(events, "a") as f:
            f.write(json.dumps(ev) + "\\n")
    emit({"event": "setup", "model": model, "spec": {}})
    for t in tasks.split(","):
        c, b = t.split(":", 1)
        emit({"event": "start", "context": int(c), "backend": b})
        if b == "crash":
            sys.exit(7)
        if b == "hang":
            time.sleep(60)
        if b == "hang-in-run":
            emit({"event": "phase", "context": int(c), "backend": b, "phase": "check"})
            time.sleep(60)
        emit({"event": "result", "model": model, "context": int(c), "backend": b, "status": "ok",
              "ms_per_step": 1.0, "bytes_per_step": 10, "error": None})
''')


def test_supervisor_survives_crash_and_hang(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    cfg = DecodeBenchConfig(models=("m",), contexts=(1, 2), backends=("a", "crash", "hang", "b"),
                            backend_timeout_s=1.5)
    results, setups = [], []
    run_model("m", cfg, results.append, setups.append, worker_cmd=[sys.executable, str(script)], poll_s=0.05)
    got = {(r["context"], r["backend"]): (r["status"], r["error"]) for r in results}
    assert len(results) == 8 and len(got) == 8  # every task reported exactly once
    for c in (1, 2):
        assert got[(c, "a")] == ("ok", None) and got[(c, "b")] == ("ok", None)
        assert got[(c, "crash")] == ("error", "worker died (exit code 7)")
        assert got[(c, "hang")][0] == "timeout"
    assert len(setups) >= 4  # a fresh worker after each crash and each kill


def test_supervisor_setup_failure_reports_all(tmp_path):
    script = tmp_path / "broken_worker.py"
    script.write_text("import sys; sys.exit(5)\n")
    cfg = DecodeBenchConfig(models=("m",), contexts=(1,), backends=("a", "b"))
    results = []
    run_model("m", cfg, results.append, lambda ev: None, worker_cmd=[sys.executable, str(script)], poll_s=0.05)
    assert [(r["backend"], r["status"]) for r in results] == [("a", "error"), ("b", "error")]
    assert "setup (exit code 5)" in results[0]["error"]


def _parse(argv):
    import argparse
    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    return p.parse_args(argv)


def test_cli_needs_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.run(_parse(["decode", "--model", "llama-3.2-1b", "--context", "1024"])) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys):
    assert bench_main.run(_parse(["decode", "--model", "no-such-model"])) == 2
    assert bench_main.run(_parse(["decode", "--model", "tiny-llama", "--backends", "bogus"])) == 2
    assert bench_main.run(_parse(["decode", "--model", "tiny-llama", "--context", "1k"])) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "bogus" in err and "--context" in err
    args = _parse(["decode", "--model", "llama-3.2-1b,llama-3.1-8b", "--backends", "torch-eager"])
    cfg = bench_main.config_from_args(args)
    assert cfg.models == ("llama-3.2-1b", "llama-3.1-8b") and cfg.contexts == (1024, 8192)
    assert cfg.backends == ("torch-eager",) and cfg.out_dir == "bench/results"
    assert DecodeBenchConfig.from_json(cfg.to_json()) == cfg
    assert parse_contexts("1024, 8192") == (1024, 8192)


def test_cli_megakernel_options_are_checked_up_front_and_travel_with_the_config(capsys):
    assert bench_main.run(_parse(["decode", "--model", "tiny-llama", "--megakernel", "inflght=4"])) == 2
    assert bench_main.run(_parse(["decode", "--model", "tiny-llama", "--megakernel", "clusters=maybe"])) == 2
    err = capsys.readouterr().err
    assert "inflght" in err and "inflight" in err and "1/0/true/false" in err
    cfg = bench_main.config_from_args(_parse(["decode", "--model", "tiny-llama", "--megakernel",
                                              "inflight=4,quiet=0"]))
    assert cfg.megakernel == "inflight=4,quiet=0" and DecodeBenchConfig.from_json(cfg.to_json()) == cfg


def test_megakernel_options_parse_to_typed_tuning_fields():
    from mimw.megakernel.plan import Tuning

    t = Tuning.parse(" inflight=5, clusters=false,quiet=0 ,")
    assert t == Tuning(inflight=5, clusters=False, quiet=0) and Tuning.parse("") == Tuning()
    for bad in ("ring", "ring=ten", "nosuch=1", "clusters=2"):
        with pytest.raises(ValueError, match="megakernel option"):
            Tuning.parse(bad)


def test_commit_and_slug(tmp_path):
    assert bench_main.git_commit(tmp_path) == "unknown"  # a copy of the tree without .git
    assert bench_main.slug("NVIDIA H200 (SXM)") == "nvidia-h200-sxm"


def test_reference_measures_bf16_noise():
    from mimw.bench.fused import random_bench_weights
    from mimw.bench.inputs import decode_inputs
    from mimw.bench.worker import Reference
    from mimw.models.spec import get_preset

    spec = get_preset("tiny-llama")
    bw = random_bench_weights(spec, dtype=torch.bfloat16, device="cpu")
    ref = Reference(bw, decode_inputs(spec, 11, dtype=torch.bfloat16, device="cpu"), torch.bfloat16)
    assert 0.0 < ref.noise < 5e-2 and ref.rel_tol == max(2e-2, 2 * ref.noise)
    c = ref.check(ref.logits)
    assert c["ok"] and c["rel_err"] == 0.0 and c["rel_err_fp32"] == pytest.approx(ref.noise)


def test_supervisor_run_phase_has_its_own_timeout(tmp_path, monkeypatch):
    from mimw.bench import supervisor

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(supervisor, "RUN_TIMEOUT_S", 0.5)
    cfg = DecodeBenchConfig(models=("m",), contexts=(1,), backends=("hang-in-run", "a"), backend_timeout_s=30.0,
                            budget_s=0.0)
    results = []
    run_model("m", cfg, results.append, lambda ev: None, worker_cmd=[sys.executable, str(script)], poll_s=0.05)
    assert [(r["backend"], r["status"]) for r in results] == [("hang-in-run", "timeout"), ("a", "ok")]
    assert "1 s" in results[0]["error"] or "0 s" in results[0]["error"]
