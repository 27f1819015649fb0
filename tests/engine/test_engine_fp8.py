"""The engine over an fp8 KV cache (reference backend): batching, chunking, preemption and prefix reuse keep the
greedy output of the fp8 oracle (the ReferenceDecoder alone over an fp8 cache), and shared pages keep their bits
and scales."""
import pytest
import torch
from engine_helpers import ByteTokenizer, greedy_alone, run_all

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams
from mimw.kv.fp8 import FP8

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
    before = {n: t[:, pages].clone() for n, t in eng.cache.page_tensors().items()}
    assert set(before) == {"k", "v", "k_scale", "v_scale"}
    run_all(eng)
    eng.add_request("b", shared + [5, 6, 7], greedy(6))
    ev = run_all(eng)["b"]
    assert ev[-1].cached_tokens == 28
    assert tokens(ev) == greedy_alone(tiny_weights, shared + [5, 6, 7], 6, FP8)
    for n, t in eng.cache.page_tensors().items():  # b read the shared pages; nobody rewrote them
        after = t[:, pages]
        assert torch.equal(after.view(torch.uint8) if t.dtype == FP8 else after,
                           before[n].view(torch.uint8) if t.dtype == FP8 else before[n])



def test_the_megakernel_backend_refuses_fp8_kv_before_looking_for_a_gpu(tiny_weights):
    from mimw.engine.backends.megakernel import MegakernelBackend

    with pytest.raises(ValueError, match="does not read FP8 KV pages yet"):
        MegakernelBackend(tiny_weights, kv_dtype=FP8)
