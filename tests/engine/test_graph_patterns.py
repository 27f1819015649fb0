"""GraphPatterns: a pattern runs eager when first seen, is captured when seen again, replays after; a wider table
drops every graph and recaptures their patterns at their next step; both maps stay bounded (CPU)."""
import random

import pytest

from mimw.engine.backends.graph_patterns import CAPTURE, EAGER, REPLAY, GraphPatterns


def test_first_sighting_eager_second_capture_then_replays():
    p = GraphPatterns(width=8)
    a, b = ((1, 1),) * 4, ((4, 4), (1, 1))
    assert [p.decide(a), p.decide(b)] == [EAGER, EAGER]
    assert p.decide(a) == CAPTURE
    p.store(a, "graph-a")
    assert [p.decide(a), p.decide(a)] == [REPLAY, REPLAY]
    assert p.graphs[a] == "graph-a" and a not in p.seen and b in p.seen
    assert (p.captures, p.eager, p.unmeasured) == (1, 2, 3)


def test_a_wider_table_drops_the_graphs_and_recaptures_their_patterns_at_once():
    p = GraphPatterns(width=8)
    a, b = ((1, 1),), ((2, 1),)
    for key in (a, a, b):
        if p.decide(key) == CAPTURE:
            p.store(key, key)
    assert not p.widen(8)  # fits: nothing dropped
    assert p.widen(9) and p.width == 16  # at least doubled
    assert p.graphs == {} and set(p.seen) == {a, b}
    assert p.decide(a) == CAPTURE  # known to repeat: no second eager step
    assert p.widen(100) and p.width == 100


def test_bounds_hold_under_random_patterns():
    rng = random.Random(0)
    p = GraphPatterns(width=4, max_graphs=3)
    keys = [((n, 1),) for n in range(1, 40)]
    counts = {EAGER: 0, CAPTURE: 0, REPLAY: 0}
    for _ in range(2000):
        key = rng.choice(keys[:5] if rng.random() < 0.7 else keys)
        what = p.decide(key)
        counts[what] += 1
        if what == CAPTURE:
            p.store(key, key)
        if what == REPLAY:
            assert p.graphs[key] == key
        assert len(p.graphs) <= 3 and len(p.seen) <= 12
        assert not set(p.graphs) & set(p.seen)
        if rng.random() < 0.01:
            p.widen(p.width + 1)
    assert (counts[CAPTURE], counts[EAGER]) == (p.captures, p.eager)
    assert counts[REPLAY] > counts[CAPTURE] > 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        GraphPatterns(width=0)
    with pytest.raises(ValueError):
        GraphPatterns(width=4, max_graphs=0)
