"""The engine serves a Qwen3-MoE model on the reference backend: batching, chunked prefill and preemption route
every token alone, so they keep the greedy output of the reference decoder run on one sequence."""
import pytest
import torch
from engine_helpers import ByteTokenizer, greedy_alone, run_all

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

PROMPTS = [[1, 5, 9, 33, 70, 12, 200, 4, 8, 100, 101, 17, 3], [7, 7, 7], list(range(40, 75)), [250, 3, 99, 42]]


@pytest.fixture(scope="module")
def moe_weights():
    return random_weights(get_preset("tiny-qwen3-moe"), seed=0)


@pytest.mark.parametrize("cfg", [
    dict(num_pages=64, page_size=4, max_batch=8, max_step_tokens=512),  # one batch: the tokens route together
    dict(num_pages=12, page_size=4, max_batch=4, max_step_tokens=8),  # chunks, page pressure: preemption
])
def test_moe_batching_and_chunking_keep_greedy_output(moe_weights, cfg):
    eng = Engine(ReferenceBackend(moe_weights), ByteTokenizer(), EngineConfig(**cfg))
    want = {f"r{i}": greedy_alone(moe_weights, p, 10) for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    events = run_all(eng)
    assert {k: [t for e in v for t in e.token_ids] for k, v in events.items()} == want
    assert eng.stats().pages_in_use == 0


def test_the_megakernel_backend_takes_moe_models_it_can_plan(moe_weights):
    """The tiny MoE model has a plan (its one-token step), so only the machine can stop the backend: without a Hopper
    GPU it says so, not that the model is MoE."""
    from mimw.engine.backends.megakernel import MegakernelBackend

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on a Hopper GPU the backend is built: tests/megakernel/test_moe_gpu.py runs the kernel")
    with pytest.raises(RuntimeError, match="Hopper"):
        MegakernelBackend(moe_weights)


def test_moe_prefill_on_the_megakernel_backend_is_the_reference_decoders(moe_weights):
    """``ReferencePrefill``: each segment's last rows of the reference decoder, written into the same cache."""
    from mimw.engine.backends.megakernel import ReferencePrefill
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.models.reference import ReferenceDecoder, Segment

    spec = moe_weights.spec
    caches = [PagedKVCache(KVLayout.for_spec(spec, 4, 8, torch.float32), "cpu") for _ in range(2)]
    segs = [Segment((0, 1), 0, 5), Segment((2, 3), 0, 3, 2)]
    toks = torch.tensor([1, 5, 9, 33, 70, 7, 7, 8])
    got = ReferencePrefill(moe_weights).forward(toks, segs, caches[0])
    want = ReferenceDecoder(moe_weights).forward(toks, segs, caches[1], last_only=True)
    assert got.shape == (3, spec.vocab_size) and got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
