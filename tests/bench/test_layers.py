"""``mimw bench decode --layers N``: a preset cut to its first N layers (real layer shapes) end to end on the CPU,
its name in the results, and the option's errors."""
import argparse
import json

import pytest

from mimw.bench import main as bench_main
from mimw.bench.bandwidth import ReadBandwidth
from mimw.bench.config import DecodeBenchConfig, preset_spec
from mimw.models.spec import SpecError, get_preset


def test_a_cut_preset_runs_with_its_floor_and_peers_over_the_same_layers(tmp_path):
    full = get_preset("tiny-qwen3-moe")
    cut = preset_spec("tiny-qwen3-moe", 2)
    assert cut.num_layers == 2 < full.num_layers and cut.name == "tiny-qwen3-moe-first2"
    assert cut.hidden_size == full.hidden_size and cut.num_experts == full.num_experts
    assert cut.moe_layers == tuple(l for l in full.moe_layers if l < 2)
    cfg = DecodeBenchConfig(models=("tiny-qwen3-moe",), contexts=(9,), backends=("mimw-reference", "torch-eager"),
                            out_dir=str(tmp_path), iters=3, warmup=1, budget_s=0.05, dtype="float32", device="cpu",
                            in_process=True, layers=2)
    assert bench_main.run_decode(cfg, "Fake GPU", lambda: ReadBandwidth(1e11, 1 << 30, "fake", 9e10)) == 0
    [j] = tmp_path.glob("*-fake-gpu-tiny-qwen3-moe-first2.json")
    doc = json.loads(j.read_text())
    rows = {r["backend"]: r for r in doc["results"]}
    assert rows["mimw-reference"]["status"] == "ok" and rows["torch-eager"]["status"] == "ok", rows
    assert rows["torch-eager"]["check"]["rel_err"] < 2e-2
    # the floor counts the cut model's bytes: its two layers' (at most every expert of them), never the whole model's
    per_step = rows["mimw-reference"]["bytes_per_step"]
    assert per_step <= cut.decode_weight_bytes() + 9 * cut.kv_bytes_per_token() < full.decode_weight_bytes()


def test_layers_is_refused_by_name_for_checkpoints_and_out_of_range(tmp_path):
    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    ok = bench_main.config_from_args(p.parse_args(["decode", "--model", "tiny-llama", "--layers", "1"]))
    assert ok.layers == 1 and bench_main.config_from_args(p.parse_args(["decode", "--model", "tiny-llama"])).layers == 0
    with pytest.raises(SpecError, match="--layers 99"):
        bench_main.config_from_args(p.parse_args(["decode", "--model", "tiny-llama", "--layers", "99"]))
    with pytest.raises(ValueError, match="--layers cuts presets"):
        bench_main.config_from_args(p.parse_args(["decode", "--model", str(tmp_path), "--layers", "1"]))
