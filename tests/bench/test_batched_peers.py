"""The peers of `mimw bench steps` (CPU): names, the step module's inputs and logit rows, the reference peer through
``measure_peer``, and refusals (no CUDA, MoE, ragged blocks). The CUDA-graph and compile peers run in
test_batched_peers_gpu.py."""
import dataclasses

import pytest
import torch

from mimw.bench.batch_steps import compare, measure_peer
from mimw.bench.peers import Unavailable
from mimw.bench.peers.batched_peers import (PEERS, StepInputs, build_peer, cache_len, parse_peers, step_module)
from mimw.engine.backends.reference import ReferenceBackend
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill.weights import FusedWeights


def test_parse_peers_orders_dedupes_and_refuses_unknown_names():
    assert parse_peers("") == ()
    assert parse_peers("torch-compile, reference,torch-compile") == ("reference", "torch-compile")
    assert parse_peers(",".join(reversed(PEERS))) == PEERS
    with pytest.raises(ValueError, match="unknown peer.*torch-eager; known: reference, torch-graph, torch-compile"):
        parse_peers("torch-graph,torch-eager")


def setup(name="tiny-qwen2", contexts=(5, 11, 2), block=3, num_logits=None, seed=0):
    spec = get_preset(name)
    w = random_weights(spec, seed=seed)
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(max(contexts) + block) // 4)
    cache = PagedKVCache(KVLayout.for_spec(spec, 4, per_seq * len(contexts), torch.float32))
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    segs = tuple(Segment(tuple(range(i * per_seq, (i + 1) * per_seq)), c, block, num_logits or block)
                 for i, c in enumerate(contexts))
    tokens = torch.randint(1, spec.vocab_size, (len(contexts) * block,), generator=g)
    return w, StepInputs(tokens, segs, cache)


def test_cache_len_is_largest_context_plus_block_rounded_to_16():
    _, inp = setup(contexts=(5, 29, 2), block=4)
    assert cache_len(inp.segments) == 48  # 29 + 4 = 33 -> 48
    _, inp = setup(contexts=(12,), block=4)
    assert cache_len(inp.segments) == 16


@pytest.mark.parametrize("num_logits", [1, 2, 3])
def test_step_module_gives_the_backends_logit_rows(num_logits):
    """The module's [B, T] output, cut to each segment's last num_logits rows, is what Backend.forward returns."""
    w, inp = setup(num_logits=num_logits)
    m, tokens, pos, rows = step_module(FusedWeights.from_weights(w), inp)
    assert tokens.shape == pos.shape == (3, 3)
    assert pos.tolist() == [[5, 6, 7], [11, 12, 13], [2, 3, 4]]
    with torch.no_grad():
        out = m(tokens, pos)
    ref = ReferenceBackend(w).forward(inp.tokens, inp.segments, inp.cache)  # [3 * num_logits, V]
    assert rows.numel() == ref.shape[0]
    torch.testing.assert_close(out.reshape(-1, out.shape[-1])[rows].float(), ref, rtol=1e-4, atol=1e-4)


def test_step_module_refuses_ragged_blocks_and_moe():
    w, inp = setup()
    fused = FusedWeights.from_weights(w)
    ragged = dataclasses.replace(inp, segments=inp.segments[:2] + (dataclasses.replace(inp.segments[2], length=2,
                                                                                          num_logits=2),))
    with pytest.raises(ValueError, match="B x T blocks"):
        step_module(fused, ragged)
    with pytest.raises(Unavailable, match="mixture-of-experts"):
        step_module(dataclasses.replace(fused, spec=get_preset("tiny-qwen3-moe")), inp)


def test_measure_peer_checks_and_times_the_reference_and_reports_unavailable_peers():
    w, inp = setup(contexts=(4, 9), block=2)
    fused = FusedWeights.from_weights(w)
    ref = ReferenceBackend(w).forward(inp.tokens, inp.segments, inp.cache)
    row: dict = {}
    cpu = torch.device("cpu")
    for name in PEERS:
        measure_peer(row, name, fused, inp, ref, cpu, budget_s=0.05)
    assert row["reference_ms"] > 0 and row["reference_build_s"] >= 0 and "reference" in row["reference_notes"]
    assert row["reference_max_rel_err"] < 1e-5 and row["reference_argmax_agree"] == 1.0
    for name in ("torch-graph", "torch-compile"):  # no CUDA here: refused by name, nothing else lost
        assert row[f"{name}_error"].startswith("unavailable:") and f"{name}_ms" not in row
    bad: dict = {}
    measure_peer(bad, "reference", fused, dataclasses.replace(inp, tokens=inp.tokens[:1]), ref, cpu, 0.05)
    assert bad["reference_error"].startswith("ValueError") and "reference_ms" not in bad


def test_compare_reports_relative_error_and_argmax_agreement():
    ref = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    x = torch.tensor([[0.0, 2.0, 1.5], [0.0, 3.5, 1.0]])
    err, agree = compare(x, ref)
    assert err == pytest.approx(3.5 / 3.0) and agree == 0.5


def test_build_peer_refuses_unknown_names():
    w, inp = setup()
    with pytest.raises(ValueError, match="unknown peer 'eager'"):
        build_peer("eager", FusedWeights.from_weights(w), inp)


def test_the_graph_peer_keeps_what_its_graph_reads_alive(monkeypatch):
    """A CUDA graph keeps only its own memory pool: the module (static caches, rope tables), tokens and positions it
    reads must live as long as the peer, or later allocations reuse them under the replays (on the GPU: an index
    assert at the second replay). Here capture is stubbed (no CUDA) and the step module's outputs are watched."""
    import gc
    import weakref

    from mimw.bench.peers import batched_peers, graph

    w, inp = setup(contexts=(4, 9), block=1)
    watched = []

    def watching(fw, step_inp):
        out = step_module(fw, step_inp)
        watched.extend(weakref.ref(t) for t in out[:3])  # module, tokens, positions
        return out

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(batched_peers, "_require_cuda", lambda fw, what: None)
    monkeypatch.setattr(batched_peers, "step_module", watching)
    monkeypatch.setattr(graph, "capture", lambda fn: (Graph(), fn()))
    with torch.no_grad():
        peer = batched_peers.torch_graph_peer(FusedWeights.from_weights(w), inp)
    gc.collect()
    assert len(watched) == 3 and all(r() is not None for r in watched)
    del peer
    gc.collect()
    assert all(r() is None for r in watched)  # held by the peer, not leaked
