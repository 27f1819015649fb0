"""The batched torch peers of `mimw bench steps` on a GPU (skipped without CUDA): the CUDA-graph and compiled
peers give the eager module's logits, replay after replay; the steps bench end to end with its peers on a tiny
model (the megakernel backend: Hopper)."""
import json

import pytest
import torch

from mimw.bench.peers.batched_peers import StepInputs, build_peer, step_module
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill.weights import FusedWeights

pytestmark = pytest.mark.gpu


def gpu_step(name, contexts, block, seed=0):
    spec = get_preset(name)
    w = FusedWeights.from_weights(random_weights(spec, seed=seed, dtype=torch.bfloat16, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-(max(contexts) + block) // 16)
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, per_seq * len(contexts)), device="cuda")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    segs = tuple(Segment(tuple(range(i * per_seq, (i + 1) * per_seq)), c, block, block)
                 for i, c in enumerate(contexts))
    tokens = torch.randint(1, spec.vocab_size, (len(contexts) * block,), device="cuda", generator=g)
    return w, StepInputs(tokens, segs, cache)


def eager_logits(w, inp):
    m, tokens, pos, rows = step_module(w, inp)
    with torch.no_grad():
        out = m(tokens, pos)
    return out.reshape(-1, out.shape[-1])[rows].float()


@pytest.mark.parametrize("contexts,block", [((100, 7, 300), 1), ((50, 200), 4)])
def test_graph_peer_replays_the_eager_module(contexts, block):
    w, inp = gpu_step("tiny-qwen3", contexts, block)
    want = eager_logits(w, inp)
    peer = build_peer("torch-graph", w, inp)
    peer.step()
    first = peer.logits().clone()
    peer.step()
    torch.cuda.synchronize()
    torch.testing.assert_close(first, want, rtol=1e-3, atol=1e-3)  # same kernels, captured
    torch.testing.assert_close(peer.logits(), first, rtol=0, atol=0)  # a replay rewrites the same rows


def test_compile_peer_matches_the_eager_module():
    w, inp = gpu_step("tiny-qwen2", (40, 130), 4, seed=1)  # biases, one KV head; one compile (max-autotune: slow)
    want = eager_logits(w, inp)
    peer = build_peer("torch-compile", w, inp)
    try:
        peer.step()
        torch.cuda.synchronize()
        got = peer.logits()
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2  # bf16: Inductor fuses differently
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75
    finally:
        peer.release()


def test_reference_peer_matches_the_eager_module():
    w, inp = gpu_step("tiny-llama", (33, 90), 2, seed=2)
    peer = build_peer("reference", w, inp)
    peer.step()
    got = peer.logits()
    want = eager_logits(w, inp)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_steps_bench_with_peers_end_to_end(tmp_path, capsys):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel backend needs a Hopper GPU")
    from mimw.bench.batch_steps import main

    # the smallest preset the megakernel plans (its tiles need head_dim >= 32: tiny-llama3's 16 is refused)
    assert main(["--model", "smollm2-135m", "--context", "100", "--batch", "1,3", "--verify", "4",
                 "--peers", "reference,torch-graph", "--budget-s", "0.1", "--out", str(tmp_path)]) == 0
    [j] = tmp_path.glob("*-batch-steps.json")
    assert list(tmp_path.glob("*-batch-steps.png")) and list(tmp_path.glob("*-batch-steps.md"))
    rows = json.loads(j.read_text())["rows"]
    assert [(r["kind"], r["segments"], r["block"]) for r in rows] == [
        ("decode", 1, 1), ("decode", 3, 1), ("verify", 1, 4), ("verify", 4, 4)]
    for r in rows:
        assert "error" not in r, r
        for p in ("reference", "torch-graph"):
            assert r[f"{p}_ms"] > 0 and r[f"{p}_max_rel_err"] < 5e-2 and r[f"{p}_argmax_agree"] >= 0.75, (p, r)
    assert "x best peer" in capsys.readouterr().out
