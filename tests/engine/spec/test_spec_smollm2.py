"""The default model (SmolLM2-135M-Instruct) on the CPU: greedy outputs with each drafter equal plain decoding's,
for a batch of input-grounded and chat prompts decoded together."""
import pytest

from mimw.bench.spec import truncated
from mimw.bench.spec_prompts import chat_prompts, grounded_prompts
from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams
from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.speculator import Speculator, make_drafter

from spec_helpers import tokens


@pytest.fixture(scope="module")
def smollm2():
    from mimw.models.checkpoint import load_model

    return load_model(None, progress=False)


def run(model, prompts, method=None, packed_linear=False):
    backend = ReferenceBackend(model.weights, packed_linear=packed_linear)
    speculator = None
    if method is not None:
        cfg = SpecConfig(method, num_tokens=6, draft_model="first-8-layers" if method == "draft" else None)
        draft = ReferenceBackend(truncated(model.weights, 8)) if method == "draft" else None
        speculator = Speculator(make_drafter(cfg, draft, 16, 256), cfg)
    eng = Engine(backend, model.tokenizer, EngineConfig(num_pages=256, page_size=16, max_batch=8),
                 model.tokenizer.eos_token_ids, speculator=speculator)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24))
    out: dict[str, list] = {}
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev)
    assert eng.stats().pages_in_use == 0
    return [tokens(out[f"r{i}"]) for i in range(len(prompts))], eng.stats().spec


@pytest.mark.slow
def test_each_drafter_keeps_the_default_models_greedy_output(smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template(list(p.messages)) for p in grounded_prompts(3) + chat_prompts(3)]
    want, _ = run(smollm2, prompts)
    for method in ("ngram", "suffix", "draft"):
        got, stats = run(smollm2, prompts, method)
        assert got == want, method
        assert stats.verify_steps > 0
    # verify blocks on oneDNN-prepacked weights (what `mimw generate` and `bench spec` run), plain on F.linear
    got, stats = run(smollm2, prompts, "suffix", packed_linear=True)
    assert got == want and stats.verify_steps > 0
