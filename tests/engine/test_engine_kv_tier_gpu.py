"""The host tier on a GPU: pinned host pool, copy streams, events and fences with the real CUDA copier."""
import pytest
import torch
from engine_helpers import ByteTokenizer, run_all

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams
from mimw.kv.prefix import chain_hashes
from mimw.kv.transfer import CudaCopier
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = pytest.mark.gpu
PS = 4


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(events):
    return [t for e in events for t in e.token_ids]


@pytest.fixture(scope="module")
def weights():
    return random_weights(get_preset("tiny-llama"), seed=0, device="cuda")


def make(weights, host_bytes, num_pages=16):
    return Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(
        num_pages=num_pages, page_size=PS, max_batch=4, max_step_tokens=64, host_kv_bytes=host_bytes))


def flood(eng, first=100):
    for i in range(3):
        eng.add_request(f"flood{first + i}", [first + i] * 3 + list(range(50, 87)), greedy(2))
        run_all(eng)


def test_restored_pages_are_bit_exact_and_give_the_recomputed_tokens_on_the_gpu(weights):
    eng = make(weights, 1 << 20)
    assert isinstance(eng.host.copier, CudaCopier) and eng.host.tensors[0].is_pinned()
    a = list(range(3, 31))
    eng.add_request("a", a, greedy(4))
    first = tokens(run_all(eng)["a"])
    hashes = chain_hashes(a + first, PS)[:7]
    before = {h: [t[:, eng.prefix.lookup(h)].clone() for t in eng.cache.page_tensors()] for h in hashes}
    flood(eng)
    assert all(eng.prefix.lookup(h) is None for h in hashes) and all(eng.host.lookup(h) is not None for h in hashes)
    a2 = a + first + [7, 8, 9, 10, 11]
    req = eng.add_request("a2", a2, greedy(6))
    out = tokens(run_all(eng)["a2"])
    assert req.num_host_cached_tokens == 28
    for h in hashes:
        now = [t[:, eng.prefix.lookup(h)] for t in eng.cache.page_tensors()]
        assert all(torch.equal(x, y) for x, y in zip(before[h], now))
    ref = make(weights, 0, num_pages=64)  # the same turns with a pool large enough to keep a's pages
    ref.add_request("a", a, greedy(4))
    run_all(ref)
    r2 = ref.add_request("a2", a2, greedy(6))
    assert out == tokens(run_all(ref)["a2"]) and r2.num_cached_tokens == 28
    torch.cuda.synchronize()
    eng.host.poll()
    assert not eng.host._loading and not eng.host._device_last and not eng.host._host_last
