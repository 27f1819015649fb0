"""The chunk policy's pure functions: the cost model, its inverse, max-min fair shares."""
import random

import pytest

from mimw.engine.chunking import attention_cost_tokens, chunk_cost, fair_shares, tokens_within
from mimw.models.spec import get_preset


def test_attention_cost_tokens_of_the_presets():
    # R = 2 x matmul params per layer / (4 x head_dim x heads): where a token's attention equals its weights
    assert attention_cost_tokens(get_preset("llama-3.2-1b")) == round(2 * 60_817_408 / (4 * 64 * 32))
    assert 26_000 < attention_cost_tokens(get_preset("llama-3.1-8b")) < 27_000
    assert 3_000 < attention_cost_tokens(get_preset("smollm2-135m")) < 3_200


def test_chunk_cost_counts_attention_over_the_context():
    assert chunk_cost(10, 500, 0) == 10
    assert chunk_cost(1, 0, 100) == 2  # ceil(1 + 1/100)
    assert chunk_cost(100, 0, 100) == 151  # 100 + 100 * 50.5 / 100 = 150.5
    assert chunk_cost(100, 1000, 100) == 1151


@pytest.mark.parametrize("r", [0, 1, 7, 300])
def test_tokens_within_is_the_longest_chunk_that_fits(r):
    rng = random.Random(r)
    for _ in range(300):
        cost, start, pending = rng.randint(1, 400), rng.randint(0, 5000), rng.randint(1, 600)
        n = tokens_within(cost, start, pending, r)
        assert 1 <= n <= pending
        assert chunk_cost(n, start, r) <= cost or n == 1
        assert n == pending or chunk_cost(n + 1, start, r) > cost
    assert tokens_within(0, 0, 10, r) == 0


def test_fair_shares_are_max_min_fair():
    assert fair_shares(20, [50, 50]) == [10, 10]
    assert fair_shares(32, [168, 5]) == [27, 5]
    assert fair_shares(3, [9, 9, 9, 9]) == [1, 1, 1, 0]
    assert fair_shares(10, [2, 0, 30]) == [2, 0, 8]
    rng = random.Random(0)
    for _ in range(500):
        demands = [rng.randint(0, 40) for _ in range(rng.randint(1, 6))]
        budget = rng.randint(0, 120)
        sh = fair_shares(budget, demands)
        assert all(0 <= s <= d for s, d in zip(sh, demands))
        assert sum(sh) == min(budget, sum(demands))
        # no unsatisfied request has less than another's share minus the one leftover unit
        for i, (s, d) in enumerate(zip(sh, demands)):
            if s < d:
                assert all(s >= t - 1 for t in sh)


def test_the_engine_takes_the_cost_model_from_its_model_unless_configured(make_engine, tiny_weights):
    assert make_engine().scheduler.cfg.attention_cost_tokens == attention_cost_tokens(tiny_weights.spec)
    assert make_engine(attention_cost_tokens=0).scheduler.cfg.attention_cost_tokens == 0
    assert make_engine(max_prefill_step_tokens=4096).scheduler.cfg.max_prefill_step_tokens == 4096
