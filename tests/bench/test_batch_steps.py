"""The multi-token step bench on the CPU: segment layout, the floor's bytes, its options, and every shape's row
through a stand-in backend (the reference backend) with the peers."""
import time

from mimw.bench.batch_steps import step_floor_bytes, step_segments
from mimw.models.spec import get_preset


def test_step_segments_give_each_sequence_its_own_pages():
    segs = step_segments(3, 4, 100, 7)
    assert [s.block_table for s in segs] == [tuple(range(0, 7)), tuple(range(7, 14)), tuple(range(14, 21))]
    assert all(s.start == 100 and s.length == 4 and s.num_logits == 4 for s in segs)


def test_step_floor_counts_weights_once_and_every_segments_kv():
    spec = get_preset("llama-3.2-1b")
    kv = spec.kv_bytes_per_token()
    one = step_floor_bytes(spec, step_segments(1, 1, 1024, 65), kv)
    eight = step_floor_bytes(spec, step_segments(8, 1, 1024, 65), kv)
    assert one == spec.decode_weight_bytes() + 1025 * kv
    assert eight - one == 7 * 1025 * kv
    verify = step_floor_bytes(spec, step_segments(2, 16, 1024, 66), kv)
    assert verify == spec.decode_weight_bytes() + 2 * 1040 * kv


def test_mimw_bench_steps_parses_and_says_it_needs_a_gpu(capsys):
    import torch

    from mimw.bench.main import main

    if torch.cuda.is_available():
        import pytest
        pytest.skip("this checks the CPU-only answer")
    assert main(["steps", "--model", "llama-3.2-1b", "--batch", "1,8", "--verify", "16"]) == 1
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_mimw_bench_steps_refuses_unknown_peers_before_any_gpu_work(capsys):
    from mimw.bench.batch_steps import main as steps_main
    from mimw.bench.main import main

    assert main(["steps", "--model", "llama-3.2-1b", "--peers", "torch-graph,vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mimw bench steps: error: --peers: unknown peer(s) vllm; known: reference, torch-graph, "
                   "torch-compile")
    assert steps_main(["--peers", "torch_compile"]) == 2
    assert "unknown peer(s) torch_compile" in capsys.readouterr().err


def test_steps_options_carry_peers_and_their_budget():
    import argparse

    from mimw.bench.batch_steps import add_options

    p = argparse.ArgumentParser()
    add_options(p)
    a = p.parse_args(["--peers", "reference,torch-graph,torch-compile", "--peer-budget-s", "120"])
    assert a.peers == "reference,torch-graph,torch-compile" and a.peer_budget_s == 120.0
    assert p.parse_args([]).peers == "" and p.parse_args([]).peer_budget_s == 0.0


class StandIn:
    """The megakernel backend's interface as the steps bench uses it, on the CPU: the reference backend for every
    path (the multi-token launch too, up to ``max_tokens`` tokens), over fp32 weights, and the fused copy the torch
    peers read."""

    def __init__(self, spec):
        import torch

        from mimw.engine.backends.reference import ReferenceBackend
        from mimw.models.weights import random_weights
        from mimw.prefill.weights import FusedWeights

        fused = FusedWeights.from_weights(random_weights(spec, seed=0))
        self.be = ReferenceBackend(fused.unfused())
        self.prefill = type("Prefill", (), {"w": fused})()
        self.make_cache = self.be.make_cache
        self.forward = self.decode_pass = self.decode_kernel = self.be.forward
        self.max_tokens = 8
        self.calls = 0
        self._torch = torch
        from mimw.engine.backends.step_router import REPLAY, StepRouter

        self.router = StepRouter()
        for _ in range(3):  # the first time is dropped as warm-up; two more make an estimate
            self.router.observe(REPLAY, 1, 1.0)

    def decode_replays(self, tokens, segments, cache):
        self.calls += 1
        return self._torch.cat([self.be.forward(tokens[i:i + 1], [s], cache) for i, s in enumerate(segments)])


def one_step_timing(step, device, max_steps=100, warmup=3, budget_s=3.0):
    """``time_steps`` cut to one step: these tests check the bench's plumbing, not its timings."""
    from mimw.bench.timing import summarize

    t = time.perf_counter()
    step()
    return summarize([(time.perf_counter() - t) * 1e3])


def test_run_model_measures_every_shape_and_each_peer_on_the_cpu(monkeypatch):
    import argparse

    import torch

    from mimw.bench import batch_steps
    from mimw.bench.batch_steps import add_options, run_model

    monkeypatch.setattr(batch_steps, "time_steps", one_step_timing)

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(["--context", "20", "--batch", "1,3", "--verify", "4", "--budget-s", "0.02",
                         "--peers", "reference,torch-graph"])
    rows = []
    mk = StandIn(get_preset("tiny-qwen3"))
    run_model("tiny-qwen3", mk, args, ("reference", "torch-graph"), torch.device("cpu"), 1e12, rows.append)
    assert [(r["kind"], r["segments"], r["block"], r["tokens"]) for r in rows] == [
        ("decode", 1, 1, 1), ("decode", 3, 1, 3), ("verify", 1, 4, 4), ("verify", 4, 4, 16)]
    assert mk.calls > 0 and rows[1]["argmax_agree"] == 1.0 and rows[1]["max_rel_err"] < 1e-5
    # the multi-token launch alone where its tokens fit (2..max_tokens), checked against one pass
    assert ["kernel_ms" in r for r in rows] == [False, True, True, False]
    assert rows[2]["kernel_argmax_agree"] == 1.0 and rows[2]["kernel_max_rel_err"] < 1e-5
    for r in rows:
        assert "error" not in r and r["mimw_ms"] > 0 and r["floor_ms"] > 0
        # the same tokens, positions and cache contents: the reference peer reproduces the backend's logits
        assert r["reference_ms"] > 0 and r["reference_max_rel_err"] < 1e-5 and r["reference_argmax_agree"] == 1.0
        assert r["torch-graph_error"].startswith("unavailable:")  # no CUDA here, refused by name
        assert r["router"] == {"replay_ms": 1.0, "step_ms": {}}  # what the backend's router knew when it chose


def test_run_model_spends_each_peers_budget_on_its_own(monkeypatch):
    import argparse

    import torch

    from mimw.bench import batch_steps
    from mimw.bench.batch_steps import add_options, run_model

    monkeypatch.setattr(batch_steps, "time_steps", one_step_timing)

    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args(["--context", "8", "--batch", "1,2", "--verify", "", "--budget-s", "0.01",
                         "--peers", "reference", "--peer-budget-s", "1e-9"])
    rows = []
    run_model("tiny-llama", StandIn(get_preset("tiny-llama")), args, ("reference", "torch-graph"),
              torch.device("cpu"), 1e12, rows.append)
    assert "reference_ms" in rows[0] and "unavailable" in rows[0]["torch-graph_error"]
    assert rows[1]["reference_error"] == "skipped: --peer-budget-s 1e-09 spent on earlier shapes"
    assert rows[1]["torch-graph_error"].startswith("skipped:")


def test_steps_take_a_kv_dtype_and_fill_an_fp8_cache_as_its_own_store_would():
    """``--kv-dtype`` (bf16 by default, fp8, nothing else); ``fill_random`` over an fp8 cache stores fp8.quantize's
    rows: re-quantising the dequantised rows gives back the same bytes and scales, and the values are a spread of
    normal draws (not zeros, not one constant); over a bf16 cache the pools hold the draws themselves."""
    import argparse

    import pytest
    import torch

    from mimw.bench.batch_steps import add_options, fill_random
    from mimw.kv import fp8
    from mimw.kv.pages import KVLayout, PagedKVCache

    p = argparse.ArgumentParser()
    add_options(p)
    assert p.parse_args([]).kv_dtype == "bf16" and p.parse_args(["--kv-dtype", "fp8"]).kv_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "fp16"])
    spec = get_preset("smollm2-135m").with_(num_layers=2)
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 3, fp8.FP8), "cpu")
    cache.k.view(torch.uint8).fill_(0x7F)  # poisoned: every byte must be written
    cache.v.view(torch.uint8).fill_(0x7F)
    fill_random(cache, torch.Generator().manual_seed(0))
    for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        x = fp8.dequantize(pool, scales)
        q, s = fp8.quantize(x)
        assert torch.equal(q.view(torch.uint8), pool.view(torch.uint8)) and torch.equal(s, scales)
        assert 0.8 < float(x.std()) < 1.2 and float(x.abs().max()) > 2.0
    assert not torch.equal(cache.k.view(torch.uint8), cache.v.view(torch.uint8))
    b16 = PagedKVCache(KVLayout.for_spec(spec, 16, 3, torch.bfloat16), "cpu")
    fill_random(b16, torch.Generator().manual_seed(0))
    assert 0.8 < float(b16.k.float().std()) < 1.2 and not torch.equal(b16.k, b16.v)
