"""The acceptance rule: greedy prefix match, point-mass drafts under sampling, and the fields that turn it off.

The statistical checks of the sampling rule are in test_spec_sampling.py."""
import dataclasses

import pytest
import torch

from mimw.engine.sampling import SamplingParams, make_generator, sample
from mimw.engine.spec.drafter import Draft
from mimw.engine.spec.verify import BLOCK_INDEPENDENT, speculation_applies, verify


def onehot_rows(tokens, vocab=10):
    out = torch.full((len(tokens), vocab), -5.0)
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


def test_greedy_keeps_the_matching_prefix_and_the_targets_next_token():
    g = SamplingParams(temperature=0)
    rows = onehot_rows([3, 4, 5, 6])  # the target's argmax after each position
    assert verify(rows, Draft((3, 4, 5)), g, None) == [3, 4, 5, 6]  # all accepted + bonus
    assert verify(rows, Draft((3, 9, 5)), g, None) == [3, 4]  # first mismatch at 1: the target's token there
    assert verify(rows, Draft((1, 4, 5)), g, None) == [3]
    assert verify(rows[:1], Draft(()), g, None) == [3]


def test_point_mass_drafts_consume_the_generator_like_plain_sampling():
    torch.manual_seed(0)
    logits = torch.randn(6, 10) * 2
    p = SamplingParams(temperature=0.9, top_k=6, seed=7)
    plain_gen = make_generator(p)
    plain = [sample(logits[j], p, plain_gen) for j in range(6)]
    for cut in range(6):  # a draft that agrees with the plain draws before `cut` and differs at `cut`
        draft = plain[:cut] + [(plain[cut] + 1) % 10] if cut < 5 else plain[:5]
        got = verify(logits[:len(draft) + 1], Draft(tuple(draft)), p, make_generator(p))
        assert got == plain[:cut + 1]

def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="expected logits"):
        verify(torch.zeros(2, 5), Draft((1, 2)), SamplingParams(temperature=0), None)
    with pytest.raises(ValueError, match="draft probs"):
        Draft((1, 2), torch.zeros(3, 5))


def test_every_current_sampling_field_is_classified():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert speculation_applies(SamplingParams(temperature=0.5, top_p=0.9, top_k=3, seed=1, stop=("x",)))
    unknown = names - BLOCK_INDEPENDENT
    for name in unknown:  # a field added later (a penalty, logprobs, ...) turns speculation off when set
        f = next(f for f in dataclasses.fields(SamplingParams) if f.name == name)
        assert speculation_applies(dataclasses.replace(SamplingParams(), **{name: f.default}))


def test_history_dependent_fields_turn_speculation_off():
    assert speculation_applies(SamplingParams(min_p=0.1, logit_bias={3: 2.0}, logprobs=3))
    for kw in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"prompt_logprobs": 0}):
        assert not speculation_applies(SamplingParams(**kw)), kw

    @dataclasses.dataclass(frozen=True)
    class WithNewField(SamplingParams):  # a field added later, unclassified: speculation stays off when it is set
        some_new_penalty: float = 0.0

    assert speculation_applies(WithNewField())
    assert not speculation_applies(WithNewField(some_new_penalty=0.5))
