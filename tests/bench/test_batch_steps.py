"""The multi-token step bench's arithmetic (CPU): segment layout and the floor's bytes."""
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
