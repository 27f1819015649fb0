"""FP8 KV in the benchmarks: ``mimw bench decode --kv-dtype fp8`` end to end on the CPU, its inputs and floor, and
``mimw bench kv-accuracy`` at a tiny scale with the real default model."""
import json

import pytest
import torch

from mimw.bench import main as bench_main
from mimw.bench.bandwidth import ReadBandwidth
from mimw.bench.config import DecodeBenchConfig
from mimw.bench.inputs import decode_inputs, paged_cache
from mimw.bench.readme import latest_runs, table
from mimw.kv import fp8
from mimw.kv.pages import KVLayout
from mimw.models.spec import get_preset


def test_fp8_decode_inputs_are_exactly_what_the_fp8_cache_holds():
    spec = get_preset("tiny-llama")
    inp = decode_inputs(spec, 37, dtype=torch.bfloat16, device="cpu", kv_dtype=fp8.FP8)
    assert inp.k.dtype == torch.float32 and inp.kv_dtype == fp8.FP8
    plain = decode_inputs(spec, 37, dtype=torch.bfloat16, device="cpu")
    assert 0 < float((inp.k - plain.k.float()).abs().max()) and torch.allclose(inp.k, plain.k.float(), rtol=2 ** -4)
    cache, table_ = paged_cache(spec, inp)
    assert cache.layout.quantized
    for layer in range(spec.num_layers):
        k, v = cache.gather(layer, table_, 37)
        assert torch.equal(k, inp.k[layer]) and torch.equal(v, inp.v[layer])


def test_fp8_floor_counts_fp8_bytes_and_scales():
    spec = get_preset("llama-3.2-1b")
    cfg = DecodeBenchConfig(models=("llama-3.2-1b",), contexts=(8,), backends=("mimw-reference",), kv_dtype="fp8")
    assert cfg.kv_bytes_per_token(spec) == 2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim + 2)
    bf16 = DecodeBenchConfig(models=("llama-3.2-1b",), contexts=(8,), backends=("mimw-reference",))
    assert bf16.kv_bytes_per_token(spec) is None  # the floor's default: bf16
    assert spec.kv_bytes_per_token() == KVLayout.for_spec(spec, 16, 1, torch.bfloat16).bytes_per_token()


def test_run_decode_with_fp8_kv_in_process(tmp_path):
    cfg = DecodeBenchConfig(models=("tiny-qwen2",), contexts=(19,), backends=("mimw-megakernel", "mimw-reference",
                            "torch-eager"), out_dir=str(tmp_path), iters=3, warmup=1, budget_s=0.05, dtype="float32",
                            device="cpu", in_process=True, kv_dtype="fp8")
    assert bench_main.run_decode(cfg, "Fake GPU", lambda: ReadBandwidth(1e11, 1 << 30, "fake", 9e10)) == 0
    [j] = tmp_path.glob("*-fake-gpu-tiny-qwen2-kv-fp8.json")
    doc = json.loads(j.read_text())
    rows = {r["backend"]: r for r in doc["results"]}
    # an fp8 run reaches the megakernel's own entry (it reads fp8 pages), which needs a Hopper GPU
    assert rows["mimw-megakernel"]["status"] == "unavailable" and "Hopper" in rows["mimw-megakernel"]["error"]
    assert rows["mimw-reference"]["status"] == "ok" and rows["torch-eager"]["status"] == "ok"
    # the same cached K/V; only the step's own new row differs (fp8 in the oracle's cache, fp32 in the peer's)
    assert 0 < rows["torch-eager"]["check"]["rel_err"] < 2e-2
    assert "fp8 cache's values" in rows["torch-eager"]["notes"]
    spec = get_preset("tiny-qwen2")
    assert rows["mimw-reference"]["bytes_per_step"] == spec.decode_weight_bytes() + 19 * cfg.kv_bytes_per_token(spec)
    assert "fp8 KV" in j.with_suffix(".md").read_text()
    [(_, d, _)] = latest_runs(tmp_path)
    assert "tiny-qwen2 (fp8 KV)" in table([(j, d, 19)])


def test_bench_decode_parses_kv_dtype():
    import argparse

    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    args = p.parse_args(["decode", "--model", "tiny-llama", "--kv-dtype", "fp8"])
    assert bench_main.config_from_args(args).kv_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["decode", "--model", "tiny-llama", "--kv-dtype", "int8"])


@pytest.mark.slow
def test_kv_accuracy_tiny_run_with_the_default_model(tmp_path):
    from mimw.bench.kv_accuracy import KVAccuracyConfig, run

    cfg = KVAccuracyConfig(tokens=40, chunk=16, generate=3, variants=("fp8-token", "fp8-page"),
                           texts=("manual@0.25",), out_dir=str(tmp_path))
    doc = run(cfg, log=lambda m: None)
    summary = {s["variant"]: s for s in doc["summary"]}
    assert set(summary) == {"bf16", "fp8-token", "fp8-page"}
    base = summary["bf16"]
    assert base["agree"] == 1.0 and base["kl_mean"] == 0.0 and base["greedy_prefix_min"] == 3
    fp8_row = summary["fp8-token"]
    assert fp8_row["positions"] == 40 and 0.5 < fp8_row["agree"] <= 1.0 and 0 < fp8_row["kl_mean"] < 0.1
    assert fp8_row["kv_bytes_per_token"] < base["kv_bytes_per_token"] / 1.8
    [md] = tmp_path.glob("*-cpu-kv-accuracy.md")
    assert "| fp8-token |" in md.read_text()
    with pytest.raises(ValueError, match="unknown"):
        KVAccuracyConfig(variants=("fp4",))
