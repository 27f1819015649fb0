"""StepCosts and the draft-length policy priced by measured step times (CPU)."""
import pytest
import torch

from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.policy import DraftLengthPolicy
from mimw.engine.step_costs import StepCosts, bucket


def test_bucket_and_warm_up():
    assert [bucket(n) for n in (1, 2, 3, 9, 17)] == [1, 2, 4, 16, 32]
    c = StepCosts()
    c.observe(1, 500.0)  # first step of its size: compilation, dropped
    assert c.relative(1, 1) is None
    c.observe(1, 1.0)
    c.observe(2, 9.0)
    c.observe(2, 2.0)
    assert c.relative(1, 1) == pytest.approx(2.0)
    assert c.relative(1, 3) is None  # bucket 4 not measured
    c.observe(3, 0.5)
    c.observe(4, 0.5)
    assert c.relative(1, 3) == 1.0  # never cheaper than the step without the drafts
    with pytest.raises(ValueError):
        c.observe(1, 0.0)
    with pytest.raises(ValueError):
        bucket(0)


def test_measured_costs_replace_the_configured_model():
    policy = DraftLengthPolicy(SpecConfig("ngram", num_tokens=8, verify_overhead=0.0, verify_token_cost=0.0))
    assert policy.best_length(0.6) == 8  # free verification: draft all K
    five_x = lambda k: 5.0  # noqa: E731 - a verify step costs 5 plain steps whatever k (an eager multi-token pass)
    assert policy.best_length(0.6, five_x) == 0  # 1 + .6 + ... + .6^8 < 2.5 tokens for 5 steps' time
    assert policy.best_length(0.95, five_x) == 8  # 6.7 tokens for 5 steps
    partial = lambda k: 1.2 if k <= 3 else None  # noqa: E731 - measured for small drafts only
    assert policy.best_length(0.6, partial) == 8  # unmeasured sizes fall back to the (free) model


def test_no_probe_when_no_acceptance_could_pay():
    cfg = SpecConfig("ngram", num_tokens=4, probe_interval=2)
    policy = DraftLengthPolicy(cfg)
    never = lambda k: 10.0  # noqa: E731 - 5 tokens at best for 10 steps' time
    for _ in range(3):
        policy.update("r", 4, 0)  # acceptance collapses
    assert [policy.length("r", never) for _ in range(6)] == [0] * 6
    slow = lambda k: 2.5  # noqa: E731 - pays only at high acceptance: probes stay
    assert 1 in [policy.length("r", slow) for _ in range(4)]


def test_timed_forward_feeds_the_backends_step_costs():
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.models.reference import Segment
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m").with_(num_layers=2)
    be = ReferenceBackend(random_weights(spec, 0, dtype=torch.float32))
    cache = be.make_cache(16, 4)
    toks = torch.randint(spec.vocab_size, (3,), generator=torch.Generator().manual_seed(0))
    for i in range(3):
        out = be.timed_forward(toks[:1], [Segment((0, 1), i, 1)], cache)
        assert out.shape == (1, spec.vocab_size)
    assert set(be.step_costs.ms) == {1} and be.step_costs.ms[1] > 0
