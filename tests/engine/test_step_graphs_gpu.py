"""StepGraphs: short steps through the prefill path's layers as CUDA graphs, against the eager pass (GPU)."""
import pytest
import torch

from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # the same kernels on the same inputs (cuBLAS may pick another algorithm under capture: a bf16 ulp)
    assert a.shape == b.shape
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-2
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_graph_replays_match_the_eager_pass_across_contexts_patterns_and_a_wider_table():
    from mimw.engine.backends.step_graphs import StepGraphs
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
    graphs = StepGraphs(runner, cache)
    assert graphs.patterns.width == 64  # MIN_TABLE_TOKENS' pages, at most the pool's
    graphs.patterns.width = 4  # a narrow start, so that the wider tables below recapture
    tables = [tuple(range(16 * i, 16 * i + 16)) for i in range(3)]
    gen = torch.Generator().manual_seed(2)
    # decode steps (one token a segment), then verify-like steps (4 tokens, every row's logits), then a mix
    steps = [((5, 40, 17), (1, 1, 1), (1, 1, 1)), ((6, 41, 18), (1, 1, 1), (1, 1, 1)),
             ((100, 3, 240), (1, 1, 1), (1, 1, 1)), ((7, 42, 19), (4, 4, 4), (4, 4, 4)),
             ((11, 46, 23), (4, 4, 4), (4, 4, 4)), ((250, 50, 30), (1, 4, 2), (1, 4, 1))]
    for i, (starts, lens, logits) in enumerate(steps):
        toks = torch.randint(spec.vocab_size, (sum(lens),), generator=gen)
        width = 4 if i < 2 else 16  # the first tables are short; later ones need a recapture, wider
        segs = [Segment(t[:max(width, -(-(s + n) // 16))], s, n, k)
                for t, s, n, k in zip(tables, starts, lens, logits)]
        assert graphs.fits(segs)
        _close(graphs.forward(toks, segs), runner.forward(toks, segs, twin))
        for layer in range(spec.num_layers):  # the same K/V rows written
            assert torch.allclose(cache.k[layer].float(), twin.k[layer].float(), rtol=2e-2, atol=2e-2)
            assert torch.allclose(cache.v[layer].float(), twin.v[layer].float(), rtol=2e-2, atol=2e-2)
    # a pattern runs eager when first seen (steps 0, 3, 5) and is captured when seen again (1, 4); step 2's wider
    # tables recaptured the decode pattern at once (known to repeat) and dropped the narrower graph
    p = graphs.patterns
    assert p.width == 16
    assert (p.captures, p.eager) == (3, 3)
    assert set(p.graphs) == {((1, 1),) * 3, ((4, 4),) * 3}
    assert set(p.seen) == {((1, 1), (4, 4), (2, 1))}
    long = [Segment(tables[0], 0, graphs.block_m + 1)]
    assert not graphs.fits(long)
    with pytest.raises(ValueError):
        graphs.forward(torch.zeros(graphs.block_m + 1, dtype=torch.long), long)


def test_decode_batches_of_one_bucket_share_one_graph_padded_on_the_pad_page():
    """With a pad page, decode batches of 5, 6 and 8 sequences run as 8 (one pattern, one graph: the first runs
    eager, the second captures, the rest replay); each gives the eager unpadded pass's logits for its real rows and
    writes the same K/V rows, and nothing but the pad page besides."""
    from mimw.engine.backends.step_graphs import StepGraphs
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.prefill import PrefillRunner

    spec = get_preset("smollm2-135m").with_(num_layers=3)
    w = random_weights(spec, 6, dtype=torch.bfloat16, device="cuda")
    runner = PrefillRunner(w)
    pad = 63
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 64, torch.bfloat16), "cuda")
    twin = PagedKVCache(KVLayout.for_spec(spec, 16, 64, torch.bfloat16), "cuda")
    for c in (cache, twin):
        c.k.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
        c.v.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    graphs = StepGraphs(runner, cache, pad_page=pad)
    perm = torch.randperm(56, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [tuple(perm[7 * i:7 * i + 7]) for i in range(8)]
    gen = torch.Generator().manual_seed(4)
    for b in (5, 6, 8, 5, 7):
        starts = torch.randint(0, 100, (b,), generator=gen).tolist()
        toks = torch.randint(spec.vocab_size, (b,), generator=gen).cuda()
        segs = [Segment(tables[i], s, 1, 1) for i, s in enumerate(starts)]
        _close(graphs.forward(toks, segs), runner.forward(toks, segs, twin))
        for layer in range(spec.num_layers):  # the same K/V rows, every page but the pad page
            assert torch.allclose(cache.k[layer][:pad].float(), twin.k[layer][:pad].float(), rtol=2e-2, atol=2e-2)
            assert torch.allclose(cache.v[layer][:pad].float(), twin.v[layer][:pad].float(), rtol=2e-2, atol=2e-2)
    p = graphs.patterns
    assert set(p.graphs) == {((1, 1),) * 8} and (p.eager, p.captures) == (1, 1)
