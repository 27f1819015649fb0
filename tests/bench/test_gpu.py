"""GPU paths (skipped without CUDA): the bandwidth kernel, and every backend on a tiny model in bf16."""
import json

import pytest
import torch

from mimw.bench import main as bench_main
from mimw.bench.config import DecodeBenchConfig

pytestmark = pytest.mark.gpu


def test_read_bandwidth_is_plausible():
    from mimw.bench.bandwidth import measure_read_bandwidth

    bw = measure_read_bandwidth(nbytes=1 << 30, reps=5)
    assert 0.5e12 < bw.bytes_per_s < 10e12 and "BLOCK" in bw.config
    assert 0.3 * bw.bytes_per_s < bw.torch_sum_bytes_per_s < 2 * bw.bytes_per_s


def test_all_backends_tiny_bf16(tmp_path):
    cfg = DecodeBenchConfig(models=("tiny-llama3",), contexts=(100,), backends=(
        "mimw-megakernel", "mimw-reference", "torch-eager", "torch-eager-graph", "torch-compile-reduce-overhead",
        "hf-transformers"), out_dir=str(tmp_path), iters=10, budget_s=0.5, in_process=True)
    assert bench_main.run_decode(cfg, torch.cuda.get_device_name()) == 0
    [j] = tmp_path.glob("*.json")
    rows = {r["backend"]: r for r in json.loads(j.read_text())["results"]}
    for b in ("mimw-reference", "torch-eager", "torch-eager-graph", "torch-compile-reduce-overhead", "hf-transformers"):
        assert rows[b]["status"] == "ok", rows[b]
        assert rows[b]["ms_per_step"] > 0 and rows[b]["check"]["rel_err"] < 2e-2
