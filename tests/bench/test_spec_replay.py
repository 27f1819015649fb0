"""spec_replay: offline replay of drafter + policy over recorded greedy outputs, priced by a verify-cost table."""
import pytest

from mimw.bench.spec_replay import cost_table, replay
from mimw.engine.spec.config import SpecConfig


def test_cost_table_interpolates_and_validates():
    v = cost_table("2:1.2,4:1.6")
    assert v(0) == 1.0 and v(1) == pytest.approx(1.1) and v(2) == 1.2 and v(3) == pytest.approx(1.4)
    assert v(9) == 1.6  # flat past the last point
    with pytest.raises(ValueError):
        cost_table("0:1.5")
    with pytest.raises(ValueError):
        cost_table("3:0.5")


def test_replay_of_a_copied_text_pays_where_verification_is_cheap_and_backs_off_where_not():
    text = list(range(100, 160))
    prompts, outputs = [[1, 2] + text + [3]], [text]  # the answer repeats the prompt: every draft is right
    cheap = replay(prompts, outputs, SpecConfig("suffix", num_tokens=8), cost_table("1:1.05,8:1.4"))
    assert cheap.tokens == 60 and cheap.accepted == cheap.drafted > 40 and cheap.speedup > 3
    costly = replay(prompts, outputs, SpecConfig("suffix", num_tokens=8), cost_table("1:9,8:9"))
    assert costly.drafted == 0 and costly.speedup == 1.0  # not even perfect acceptance pays: no probe either
    noise = [[(t * 7919) % 50_000 for t in range(60)]]  # an answer unrelated to the prompt
    r = replay(prompts, noise, SpecConfig("ngram", num_tokens=8), cost_table("1:1.05,8:1.4"))
    assert r.accepted == 0 and 0.9 < r.speedup <= 1.0  # a few probes, never much slower than plain
