"""The engine serves a Qwen3-MoE model on the reference backend: batching, chunked prefill and preemption route
every token alone, so they keep the greedy output of the reference decoder run on one sequence."""
import pytest
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


def test_the_megakernel_backend_refuses_moe_models_before_touching_a_gpu(moe_weights):
    from mimw.engine.backends.megakernel import MegakernelBackend

    with pytest.raises(ValueError, match="mixture-of-experts.*reference backend"):
        MegakernelBackend(moe_weights)
