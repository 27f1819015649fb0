"""DecodeGraphs: decode batches through the prefill path's layers as CUDA graphs, against the eager pass (GPU)."""
import pytest
import torch

from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]


def test_graph_replays_match_the_eager_pass_across_contexts_and_a_wider_table():
    from mimw.engine.backends.decode_graphs import DecodeGraphs
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.prefill import PrefillRunner

    spec = get_preset("smollm2-135m").with_(num_layers=3)
    w = random_weights(spec, 5, dtype=torch.bfloat16, device="cuda")
    runner = PrefillRunner(w)
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 64, torch.bfloat16), "cuda")
    twin = PagedKVCache(KVLayout.for_spec(spec, 16, 64, torch.bfloat16), "cuda")
    for c in (cache, twin):
        c.k.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
        c.v.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    graphs = DecodeGraphs(runner, cache)
    tables = [tuple(range(16 * i, 16 * i + 16)) for i in range(3)]
    gen = torch.Generator().manual_seed(2)
    for step, starts in enumerate([(5, 40, 17), (6, 41, 18), (100, 3, 200), (250, 1, 33)]):
        toks = torch.randint(spec.vocab_size, (3,), generator=gen)
        width = 4 if step < 2 else 16  # the first tables are short; later ones need a recapture, wider
        segs = [Segment(t[:max(width, -(-(s + 1) // 16))], s, 1) for t, s in zip(tables, starts)]
        a = graphs.forward(toks, segs)
        b = runner.forward(toks, segs, twin)
        assert a.shape == b.shape == (3, spec.vocab_size)
        # the same kernels on the same inputs (cuBLAS may pick another algorithm under capture: a bf16 ulp)
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-2, f"step {step}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        for layer in range(spec.num_layers):  # the same K/V rows written
            assert torch.allclose(cache.k[layer].float(), twin.k[layer].float(), rtol=2e-2, atol=2e-2)
            assert torch.allclose(cache.v[layer].float(), twin.v[layer].float(), rtol=2e-2, atol=2e-2)
    assert graphs.width >= 13 and set(graphs.graphs) == {3}
    a = graphs.forward(toks[:2], segs[:2])  # another batch size: its own graph
    assert set(graphs.graphs) == {2, 3}
    b = runner.forward(toks[:2], segs[:2], twin)
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-2
