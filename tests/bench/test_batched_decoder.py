"""BatchedDecoder (behind the batched torch peers of `mimw bench steps`) matches the reference decoder in fp32 on CPU
over a paged cache: decode batches with a different context per sequence, verify blocks (every token's logits), and
the cache rows it writes."""
import pytest
import torch

from mimw.bench.peers.batched_decoder import BatchedDecoder
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill.weights import FusedWeights

PAGE = 4


def paged_setup(spec, contexts, block, seed=0):
    """A paged pool with random K/V, each sequence on scattered pages (block tables out of order), room for its
    context plus ``block`` new tokens."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + block) // PAGE) for c in contexts]
    cache = PagedKVCache(KVLayout.for_spec(spec, PAGE, sum(need) + 3, torch.float32))
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(tuple(perm[i:i + n]))
        i += n
    tokens = torch.randint(1, spec.vocab_size, (len(contexts), block), generator=g)
    return cache, tables, tokens


def run_both(name, contexts, block):
    spec = get_preset(name)
    w = random_weights(spec, seed=1)
    cache, tables, tokens = paged_setup(spec, contexts, block)
    m = BatchedDecoder(FusedWeights.from_weights(w), len(contexts), -(-(max(contexts) + block) // 16) * 16)
    m.load_paged(cache, tables, contexts)  # rows [0, ctx): before the reference writes the step's own rows
    pos = torch.tensor(contexts)[:, None] + torch.arange(block)[None, :]
    with torch.no_grad():
        out = m(tokens, pos)
        again = m(tokens, pos)  # the step is repeatable: it rewrites the same rows
    segs = [Segment(t, c, block, block) for t, c in zip(tables, contexts)]
    ref = ReferenceDecoder(w).forward(tokens.reshape(-1), segs, cache, last_only=True)  # [B*T, V]
    return spec, m, cache, tables, out, again, ref


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"])
def test_decode_batch_with_different_contexts_matches_reference(name):
    contexts = [7, 13, 1, 30]
    spec, m, cache, tables, out, again, ref = run_both(name, contexts, 1)
    assert out.shape == (4, 1, spec.vocab_size)
    torch.testing.assert_close(out.reshape(-1, spec.vocab_size), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, out)
    # the step's K/V landed at (b, ctx_b) of the module's cache, as the reference wrote them into the pages
    for li in range(spec.num_layers):
        for b, (t, c) in enumerate(zip(tables, contexts)):
            k, v = cache.gather(li, t, c + 1)
            torch.testing.assert_close(m.layers[li].k_cache[b, :, :c + 1], k.transpose(0, 1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(m.layers[li].v_cache[b, :, :c + 1], v.transpose(0, 1), rtol=1e-5, atol=1e-5)
            assert not m.layers[li].k_cache[b, :, c + 1:].any()  # nothing past the step's rows


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_verify_block_matches_reference_for_every_token(name):
    contexts = [9, 22, 3]
    spec, m, _, _, out, _, ref = run_both(name, contexts, 4)
    assert out.shape == (3, 4, spec.vocab_size)
    torch.testing.assert_close(out.reshape(-1, spec.vocab_size), ref, rtol=1e-4, atol=1e-4)
    # causal inside the block: a token's logits do not depend on the block's later tokens
    assert not torch.allclose(out[:, 0], out[:, 1])


def test_verify_block_is_causal_inside_itself():
    spec = get_preset("tiny-llama")
    w = FusedWeights.from_weights(random_weights(spec, seed=2))
    cache, tables, tokens = paged_setup(spec, [10, 5], 4, seed=3)
    pos = torch.tensor([[10], [5]]) + torch.arange(4)
    m = BatchedDecoder(w, 2, 16)
    m.load_paged(cache, tables, [10, 5])
    changed = tokens.clone()
    changed[:, 3] = (changed[:, 3] + 1) % spec.vocab_size
    with torch.no_grad():
        a, b = m(tokens, pos), m(changed, pos)
    torch.testing.assert_close(a[:, :3], b[:, :3])  # the last token is invisible to the earlier ones
    assert not torch.allclose(a[:, 3], b[:, 3])


def test_weights_are_shared_not_copied():
    spec = get_preset("tiny-qwen2")
    w = FusedWeights.from_weights(random_weights(spec, seed=0))
    m = BatchedDecoder(w, 2, 16)
    assert m.layers[1].wqkv.data_ptr() == w.layers[1].wqkv.data_ptr()
    assert m.layers[0].bqkv.data_ptr() == w.layers[0].bqkv.data_ptr()
    assert m.lm_head is m.embed and m.embed.data_ptr() == w.embed.data_ptr()  # tied preset
    assert m.layers[0].k_cache.shape == (2, spec.num_kv_heads, 16, spec.head_dim)


def test_load_paged_checks_its_arguments():
    spec = get_preset("tiny-llama")
    w = FusedWeights.from_weights(random_weights(spec, seed=0))
    cache, tables, _ = paged_setup(spec, [16, 3], 1)
    m = BatchedDecoder(w, 2, 16)
    with pytest.raises(ValueError, match="no row for a new token"):
        m.load_paged(cache, tables, [16, 3])
    with pytest.raises(ValueError, match="expected 2 block tables"):
        m.load_paged(cache, tables[:1], [3])


def test_moe_is_refused():
    import dataclasses

    dense = FusedWeights.from_weights(random_weights(get_preset("tiny-qwen3"), seed=0))
    with pytest.raises(ValueError, match="mixture-of-experts"):  # the spec decides, before any layer is read
        BatchedDecoder(dataclasses.replace(dense, spec=get_preset("tiny-qwen3-moe")), 1, 16)


def test_traces_as_one_graph():
    """fullgraph=True as the compile peer uses it (aot_eager: tracing + functionalization, no code generation)."""
    spec = get_preset("tiny-qwen3")
    w = random_weights(spec, seed=0)
    cache, tables, tokens = paged_setup(spec, [6, 11], 2)
    m = BatchedDecoder(FusedWeights.from_weights(w), 2, 16)
    m.load_paged(cache, tables, [6, 11])
    pos = torch.tensor([[6], [11]]) + torch.arange(2)
    with torch.no_grad():
        eager = m(tokens, pos)
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=False)(tokens, pos)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
