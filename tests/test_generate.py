import pytest
import torch

from mimw.engine.sampling import SamplingParams
from mimw.generate import generate
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import ModelWeights, random_weights

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def weights():
    return random_weights(get_preset("tiny-qwen3"), seed=11)


def _with_spec(w, **changes):
    return ModelWeights(w.spec.with_(**changes), w.embed, w.layers, w.final_norm, w.lm_head)


def _tokens(steps):
    assert steps[-1].token_id is None and all(s.token_id is not None for s in steps[:-1])
    return [s.token_id for s in steps[:-1]], steps[-1].finish_reason


def test_greedy_decode_matches_full_recompute(weights):
    toks, reason = _tokens(list(generate(weights, PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                                                          ignore_eos=True), page_size=4)))
    assert reason == "length" and len(toks) == 10
    seq = list(PROMPT)
    for t in toks:  # each token is the argmax of a from-scratch forward over the whole sequence so far
        cache = PagedKVCache(KVLayout.for_spec(weights.spec, 4, 8, torch.float32))
        logits = ReferenceDecoder(weights).forward(torch.tensor(seq), [Segment(tuple(range(8)), 0, len(seq))],
                                                   cache)[-1]
        assert logits[t] >= logits.max() - 1e-5
        seq.append(t)


def test_fp8_kv_greedy_decode_matches_full_recompute_over_an_fp8_cache(weights):
    from mimw.kv.fp8 import FP8

    toks, _ = _tokens(list(generate(weights, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    page_size=4, kv_dtype=FP8)))
    seq = list(PROMPT)
    for t in toks:  # the decode loop's cache holds what a from-scratch prefill into an fp8 cache holds
        cache = PagedKVCache(KVLayout.for_spec(weights.spec, 4, 8, FP8))
        logits = ReferenceDecoder(weights).forward(torch.tensor(seq), [Segment(tuple(range(8)), 0, len(seq))],
                                                   cache)[-1]
        assert logits[t] >= logits.max() - 1e-5
        seq.append(t)


def test_eos_and_stop_token_ids_end_generation(weights):
    first = _tokens(list(generate(weights, PROMPT, SamplingParams(temperature=0, max_tokens=1))))[0][0]
    toks, reason = _tokens(list(generate(_with_spec(weights, eos_token_ids=(first,)), PROMPT,
                                         SamplingParams(temperature=0, max_tokens=5))))
    assert toks == [] and reason == "stop"
    toks, reason = _tokens(list(generate(_with_spec(weights, eos_token_ids=(first,)), PROMPT,
                                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))))
    assert toks[0] == first and reason == "length"
    toks, reason = _tokens(list(generate(weights, PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                                          stop_token_ids=(first,)))))
    assert toks == [] and reason == "stop"


def test_context_limit(weights):
    toks, reason = _tokens(list(generate(_with_spec(weights, max_position_embeddings=8), PROMPT,
                                         SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))))
    assert len(PROMPT) + len(toks) == 8 and reason == "context"


def test_seeded_sampling_is_reproducible(weights):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_k=50, seed=seed, max_tokens=8, ignore_eos=True)
        return _tokens(list(generate(weights, PROMPT, p)))[0]
    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1, 256], SamplingParams(), "outside the model's vocabulary"),
    (list(range(1, 100)) * 6, SamplingParams(), "context"),
    ([1, 2], SamplingParams(stop=("x",)), "tokenizer"),
])
def test_bad_requests(weights, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        next(generate(weights, prompt, params))


class _Bytes:
    """UTF-8 bytes as token ids (a tokenizer for the random-weight model); no EOS."""

    eos_token_ids = ()

    def decode(self, ids):
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


@pytest.mark.parametrize("method", [None, "ngram", "suffix"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(0,))])
def test_the_engine_route_keeps_the_protocol_and_the_tokens(weights, method, params):
    from mimw.engine.spec.config import SpecConfig
    from mimw.generate import generate_with_engine
    from mimw.models.checkpoint import LoadedModel

    prompt = PROMPT * 3
    want = list(generate(weights, prompt, params, tokenizer=_Bytes()))
    model = LoadedModel(weights.spec, weights, _Bytes(), "test")
    stats = []
    got = list(generate_with_engine(model, prompt, params, _Bytes(), SpecConfig(method) if method else None,
                                    on_stats=stats.append))
    assert _tokens(got) == _tokens(want)
    assert "".join(s.text for s in got) == "".join(s.text for s in want)
    if method:
        assert stats[0].spec.verify_steps > 0


def test_the_engine_route_reports_the_context_limit(weights):
    from mimw.engine.spec.config import SpecConfig
    from mimw.generate import generate_with_engine
    from mimw.models.checkpoint import LoadedModel

    w = _with_spec(weights, max_position_embeddings=12)
    model = LoadedModel(w.spec, w, _Bytes(), "test")
    toks, reason = _tokens(list(generate_with_engine(model, PROMPT, SamplingParams(temperature=0, max_tokens=50,
                                                                                       ignore_eos=True),
                                                     _Bytes(), SpecConfig("ngram"))))
    assert len(PROMPT) + len(toks) == 12 and reason == "context"
