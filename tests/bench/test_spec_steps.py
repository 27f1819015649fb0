"""The GPU estimate's arithmetic and a CPU run of its timing loop on the tiny model."""
import json

import pytest

from mimw.bench.spec_steps import block_mix, estimate, main


def test_block_mix_and_estimate():
    plain_tokens, blocks = block_mix({"tokens": 100, "blocks": {"4,3": 10, "4,0": 5, "2,1": 10}})
    assert plain_tokens == 100 - 40 - 5 - 20 and blocks == {4: [(3, 10), (0, 5)], 2: [(1, 10)]}
    est = estimate(1.0, {2: 1.5, 4: 2.0}, plain_tokens, blocks)
    # 35 plain tokens at 1 ms, 15 four-token verifies at 2 ms, 10 two-token verifies at 1.5 ms -> 80 ms / 100 tokens
    assert est["spec_ms_per_token"] == pytest.approx(0.8) and est["speedup"] == pytest.approx(1.25)


def test_runs_on_the_cpu_with_the_reference_backend(tmp_path, capsys):
    results = tmp_path / "cpu.json"
    results.write_text(json.dumps({"summary": {"chat": {"plain": {"tokens": 10},
                                                        "ngram": {"tokens": 10, "blocks": {"2,1": 2}}}}}))
    assert main(["--results", str(results), "--model", "tiny-llama", "--backend", "reference", "--device", "cpu",
                 "--dtype", "float32", "--context", "32", "--budget-s", "0.05", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny-llama | reference | chat | ngram |" in out
    [written] = tmp_path.glob("*-spec-steps.json")
    assert set(json.loads(written.read_text())["timings_ms"]["tiny-llama/reference"]) == {"0", "1", "2"}
