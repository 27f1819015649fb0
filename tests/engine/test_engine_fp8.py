"""The engine over an fp8 KV cache (reference backend): batching, chunking, preemption, prefix reuse and the host
tier keep the greedy output of the fp8 oracle (the ReferenceDecoder alone over an fp8 cache), and shared or restored
pages keep their bits and scales."""
import pytest
import torch
from engine_helpers import ByteTokenizer, greedy_alone, run_all

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams
from mimw.kv.fp8 import FP8
from mimw.kv.pages import KVLayout

PROMPTS = [[1, 5, 9, 33, 70, 12, 200, 4, 8, 100, 101, 17, 3], [7, 7, 7], list(range(40, 75)), [250, 3, 99, 42]]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def fp8_engine(weights, **cfg) -> Engine:
    return Engine(ReferenceBackend(weights, kv_dtype=FP8), ByteTokenizer(), EngineConfig(**cfg))


def tokens(events):
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("cfg", [
    dict(num_pages=64, page_size=4, max_batch=2, max_step_tokens=8),  # chunked prefill, few slots
    dict(num_pages=12, page_size=4, max_batch=4, max_step_tokens=64),  # page pressure: preemption, recompute
])
def test_fp8_batching_chunking_and_preemption_keep_greedy_output(tiny_weights, cfg):
    eng = fp8_engine(tiny_weights, **cfg)
    assert eng.cache.layout.quantized and eng.cache.k.dtype == FP8
    want = {f"r{i}": greedy_alone(tiny_weights, p, 10, FP8) for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(10))
    assert {k: tokens(v) for k, v in run_all(eng).items()} == want
    s = eng.stats()
    assert s.pages_in_use == 0 and (s.preemptions > 0) == (cfg["num_pages"] == 12)


def test_fp8_prefix_reuse_reads_shared_pages_with_their_scales(tiny_weights):
    eng = fp8_engine(tiny_weights, num_pages=64, page_size=4)
    shared = list(range(10, 40))
    a = eng.add_request("a", shared + [1, 2], greedy(4))
    eng.step()  # a's prompt is prefilled: its first 7 pages hold the shared tokens
    pages = list(a.block_table[:7])
    before = [t[:, pages].clone() for t in eng.cache.page_tensors()]
    assert len(before) == 4  # k, v (as bytes), k_scale, v_scale
    run_all(eng)
    eng.add_request("b", shared + [5, 6, 7], greedy(6))
    ev = run_all(eng)["b"]
    assert ev[-1].cached_tokens == 28
    assert tokens(ev) == greedy_alone(tiny_weights, shared + [5, 6, 7], 6, FP8)
    for t, b in zip(eng.cache.page_tensors(), before):  # b read the shared pages; nobody rewrote them
        assert torch.equal(t[:, pages], b)



def test_the_megakernel_backend_takes_fp8_kv_and_refuses_what_it_cannot_serve_before_looking_for_a_gpu(
        tiny_weights):
    """A dense model over an fp8 cache passes the flag checks (here it stops only for want of a Hopper GPU); an
    element type the kernel has no path for and an MoE model over fp8 (megakernel/plan.py) are refused by name,
    before any GPU work."""
    import torch

    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on a Hopper GPU the backend is built: tests/prefill/test_prefill_gpu.py runs it over fp8")
    with pytest.raises(RuntimeError, match="Hopper"):
        MegakernelBackend(tiny_weights, kv_dtype=FP8)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        MegakernelBackend(tiny_weights, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="mixture-of-experts model over a bf16 KV cache only"):
        MegakernelBackend(random_weights(get_preset("tiny-qwen3-moe"), seed=0), kv_dtype=FP8)


def test_fp8_pages_restored_from_the_host_tier_keep_bits_scales_and_output(tiny_weights):
    from mimw.kv.prefix import chain_hashes

    cfg = dict(num_pages=16, page_size=4, max_batch=4, max_step_tokens=64)
    per_page = KVLayout.for_spec(tiny_weights.spec, 4, 1, FP8).bytes_per_page()  # scales included
    eng = Engine(ReferenceBackend(tiny_weights, kv_dtype=FP8), ByteTokenizer(),
                 EngineConfig(**cfg, host_kv_bytes=64 * per_page))
    a = list(range(3, 31))  # 7 full pages
    eng.add_request("a", a, greedy(4))
    first = tokens(run_all(eng)["a"])
    hashes = chain_hashes(a, 4)
    before = {h: [t[:, eng.prefix.lookup(h)].clone() for t in eng.cache.page_tensors()] for h in hashes}
    for i in range(3):  # unrelated requests that need the whole device pool: a's pages go to the host
        eng.add_request(f"flood{i}", [100 + i] * 3 + list(range(50, 87)), greedy(2))
        run_all(eng)
    assert all(eng.prefix.lookup(h) is None and eng.host.lookup(h) is not None for h in hashes)
    a2 = a + first + [7, 8, 9]
    req = eng.add_request("a2", a2, greedy(6))
    out = tokens(run_all(eng)["a2"])
    assert req.num_host_cached_tokens == 28
    for h, kv in before.items():
        assert all(torch.equal(x, t[:, eng.prefix.lookup(h)]) for x, t in zip(kv, eng.cache.page_tensors()))
    assert out == greedy_alone(tiny_weights, a2, 6, FP8)
