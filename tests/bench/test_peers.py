"""Peers on the CPU: reference, torch eager and transformers agree with the reference logits; CUDA-only peers
report themselves unavailable instead of failing."""
import pytest
import torch

from mimw.bench.check import compare_logits
from mimw.bench.fused import random_bench_weights
from mimw.bench.inputs import decode_inputs, reference_logits
from mimw.bench.peers import BACKENDS, PeerContext, Unavailable, is_mimw, parse_backends
from mimw.bench.peers.base import cache_len_for
from mimw.models.spec import get_preset


def _ctx(name: str, context: int = 19) -> tuple[PeerContext, torch.Tensor]:
    spec = get_preset(name)
    bw = random_bench_weights(spec, seed=0, dtype=torch.float32, device="cpu")
    inputs = decode_inputs(spec, context, dtype=torch.float32, device="cpu")
    return PeerContext(bw, inputs, torch.device("cpu"), max_steps=8), reference_logits(bw.weights, inputs)


@pytest.mark.parametrize("backend", ["mimw-reference", "torch-eager"])
def test_cpu_peer_matches_reference(backend):
    ctx, ref = _ctx("tiny-qwen3")
    peer = BACKENDS[backend](ctx)
    with torch.no_grad():
        peer.reset()
        peer.step()
        c = compare_logits(peer.logits(), ref, rel_tol=1e-4)
    assert c.ok, c


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"])
def test_transformers_peer_matches_reference(name):
    pytest.importorskip("transformers")
    ctx, ref = _ctx(name)
    peer = BACKENDS["hf-transformers"](ctx)
    assert "eager" in peer.notes
    with torch.no_grad():
        peer.reset()
        peer.step()
        first = compare_logits(peer.logits(), ref, rel_tol=1e-4)
        for _ in range(ctx.max_steps + 16):  # the StaticCache counter advances; its spare rows absorb it
            peer.step()
        peer.reset()
        peer.step()
        again = compare_logits(peer.logits(), ref, rel_tol=1e-4)
    assert first.ok and again.ok, (first, again)


@pytest.mark.parametrize("backend", ["torch-eager-graph", "torch-compile-reduce-overhead",
                                     "torch-compile-max-autotune"])
def test_cuda_only_peers_are_unavailable_on_cpu(backend):
    ctx, _ = _ctx("tiny-llama")
    with pytest.raises(Unavailable, match="CUDA"):
        BACKENDS[backend](ctx)


def test_backend_names():
    assert parse_backends("all") == list(BACKENDS) and parse_backends(None) == list(BACKENDS)
    assert parse_backends("hf-transformers,mimw-reference") == ["mimw-reference", "hf-transformers"]  # run order
    with pytest.raises(ValueError, match="nope"):
        parse_backends("torch-eager,nope")
    assert [b for b in BACKENDS if is_mimw(b)] == ["mimw-megakernel", "mimw-reference"]
    assert cache_len_for(1024) == 1040 and cache_len_for(1023) == 1024


def test_the_graph_peer_keeps_what_its_graph_reads_alive(monkeypatch):
    """A CUDA graph keeps only its own memory pool: the module (static caches), token and position it reads must live
    as long as the peer, or later allocations reuse them under the replays. Capture is stubbed here (no CUDA)."""
    import gc
    import weakref

    from mimw.bench.peers import graph, torch_peers

    ctx, _ = _ctx("tiny-qwen3")
    watched, module = [], torch_peers._module

    def watching(c):
        out = module(c)
        watched.extend(weakref.ref(t) for t in out)  # module, token, position
        return out

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch_peers, "require_cuda", lambda c, what: None)
    monkeypatch.setattr(torch_peers, "_module", watching)
    monkeypatch.setattr(torch_peers, "capture", lambda fn: (Graph(), fn()))
    with torch.no_grad():
        peer = torch_peers.torch_eager_graph(ctx)
    gc.collect()
    assert len(watched) == 3 and all(r() is not None for r in watched)
    del peer
    gc.collect()
    assert all(r() is None for r in watched)
