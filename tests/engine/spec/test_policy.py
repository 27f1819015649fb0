"""Draft length policy: the E(k)/c(k) optimum, back-off with probes, and recovery."""
import pytest

from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.policy import DraftLengthPolicy


def test_best_length_follows_acceptance_and_cost():
    p = DraftLengthPolicy(SpecConfig("ngram", num_tokens=8, verify_token_cost=0.05))
    assert p.best_length(0.95) == 8
    assert 0 < p.best_length(0.5) < 8
    assert p.best_length(0.01) == 0  # 1.01 tokens for 1.05 steps: plain decoding is faster
    costly = DraftLengthPolicy(SpecConfig("ngram", num_tokens=8, verify_overhead=1.0))
    assert costly.best_length(0.5) == 0 and costly.best_length(0.95) == 8  # a slow verify path needs high acceptance


def test_low_acceptance_backs_off_and_probes_then_recovers():
    p = DraftLengthPolicy(SpecConfig("ngram", num_tokens=8, drafter_token_cost=0.4, probe_interval=4))
    assert p.length("r") > 0  # a new request starts at alpha = 1/2
    for _ in range(10):
        p.update("r", 4, 0)
    lengths = [p.length("r") for _ in range(8)]
    assert lengths == [0, 0, 0, 1, 0, 0, 0, 1]  # backed off, one probe token every 4 steps
    for _ in range(6):
        p.update("r", 1, 1)
        p.update("r", 8, 8)
    assert p.alpha("r") > 0.9 and p.length("r") >= 4  # recovered (a costly drafter stops short of K)
    p.forget("r")
    assert p.alpha("r") == pytest.approx(0.5)


def test_config_validation():
    with pytest.raises(ValueError, match="one of"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="draft-model"):
        SpecConfig("draft")
    with pytest.raises(ValueError):
        SpecConfig("ngram", num_tokens=0)
