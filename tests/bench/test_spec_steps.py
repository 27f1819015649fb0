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


def test_each_shape_is_timed_after_the_backend_settled():
    """A backend that is slow for a shape's first steps (a router trying its paths) is timed at its settled cost:
    every shape gets SETTLE_STEPS untimed steps first."""
    import time

    import torch

    from mimw.bench.spec_steps import SETTLE_STEPS, time_verify_steps
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.models.spec import get_preset

    spec = get_preset("tiny-llama")

    class Trying:
        device = torch.device("cpu")

        def __init__(self):
            self.calls = {}

        def make_cache(self, page, pages):
            return PagedKVCache(KVLayout.for_spec(spec, page, pages), "cpu")

        def forward(self, toks, segs, cache):
            n = self.calls[len(toks)] = self.calls.get(len(toks), 0) + 1
            time.sleep(0.02 if n <= SETTLE_STEPS - 4 else 0.001)  # the trial ends a few steps before the timing

    b = Trying()
    out = time_verify_steps(b, spec, 8, 2, torch.device("cpu"), budget_s=0.05)
    assert sorted(out) == [0, 1, 2] and all(v < 10 for v in out.values()), out
    assert all(n > SETTLE_STEPS for n in b.calls.values())
