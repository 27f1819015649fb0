"""Decode inputs are deterministic, and the paged copy holds exactly the prefix."""
import torch

from mimw.bench.inputs import decode_inputs, paged_cache
from mimw.models.spec import get_preset


def test_decode_inputs_deterministic():
    spec = get_preset("tiny-qwen3")
    a = decode_inputs(spec, 21, seed=2, dtype=torch.float32, device="cpu")
    b = decode_inputs(spec, 21, seed=2, dtype=torch.float32, device="cpu")
    assert a.k.shape == (spec.num_layers, 21, spec.num_kv_heads, spec.head_dim)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.token == b.token
    assert 0 < a.token < spec.vocab_size and not torch.equal(a.k, a.v)
    assert decode_inputs(spec, 0, dtype=torch.float32, device="cpu").k.shape[1] == 0


def test_paged_cache_round_trip():
    spec = get_preset("tiny-llama")
    inp = decode_inputs(spec, 37, dtype=torch.float32, device="cpu")
    cache, table = paged_cache(spec, inp, page_size=16)
    assert len(table) == 3  # positions 0..37 need 38 rows = 3 pages of 16
    for layer in range(spec.num_layers):
        k, v = cache.gather(layer, table, 37)
        assert torch.equal(k, inp.k[layer]) and torch.equal(v, inp.v[layer])
