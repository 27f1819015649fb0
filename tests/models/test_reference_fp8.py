"""The reference decoder over an fp8 KV cache: it attends to exactly the dequantised values the cache holds, and
its logits stay close to the bf16/fp32-KV oracle's."""
import pytest
import torch

from mimw.bench.check import rel_err
from mimw.bench.kv_variants import SimulatedCache
from mimw.kv import fp8
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

N, PS = 40, 8


def _run(weights, cache) -> torch.Tensor:
    """Prefill N tokens in two chunks, then decode two: logits of every token [N + 2, V]."""
    toks = torch.randint(weights.spec.vocab_size, (N + 2,), generator=torch.Generator().manual_seed(3))
    table, dec = tuple(range(cache.layout.num_pages)), ReferenceDecoder(weights)
    out = [dec.forward(toks[:25], [Segment(table, 0, 25)], cache),
           dec.forward(toks[25:N], [Segment(table, 25, N - 25)], cache)]
    out += [dec.forward(toks[i:i + 1], [Segment(table, i, 1)], cache) for i in (N, N + 1)]
    return torch.cat(out)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def weights(request):
    return random_weights(get_preset(request.param), seed=5)


def _cache(weights, dtype):
    return PagedKVCache(KVLayout.for_spec(weights.spec, PS, -(-(N + 2) // PS), dtype))


def test_the_oracle_attends_to_the_dequantised_values(weights):
    real = _run(weights, _cache(weights, fp8.FP8))
    layout = KVLayout.for_spec(weights.spec, PS, -(-(N + 2) // PS), torch.float32)
    simulated = _run(weights, SimulatedCache(layout, lambda _n, _l, x: fp8.dequantize(*fp8.quantize(x))))
    assert torch.equal(real, simulated)


def test_fp8_logits_stay_close_to_the_bf16_and_fp32_kv_oracle(weights):
    exact = _run(weights, _cache(weights, torch.float32))
    bf16 = rel_err(_run(weights, _cache(weights, torch.bfloat16)), exact)
    f8 = rel_err(_run(weights, _cache(weights, fp8.FP8)), exact)
    assert 0 < bf16 < f8 < 5e-2  # e4m3 keeps 4 significant bits, bf16 8: fp8 is the noisier of the two
    assert f8 < 32 * bf16
