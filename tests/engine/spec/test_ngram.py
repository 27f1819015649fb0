"""Prompt lookup: the continuation of the latest earlier occurrence of the longest matching n-gram."""
from mimw.engine.sampling import SamplingParams
from mimw.engine.spec.drafter import DraftInput
from mimw.engine.spec.ngram import NgramDrafter

P = SamplingParams(temperature=0)


def x(tokens, rid="r"):
    return DraftInput(rid, list(tokens), 1, P)


def test_copies_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter(1, 4)
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert d.propose_one(x(toks), 3) == [7, 8, 5]  # "1 2 3" last seen before position 8 -> 7 8 5
    assert d.propose_one(x(toks), 1) == [7]


def test_longest_n_wins_over_a_later_shorter_match():
    d = NgramDrafter(1, 4)
    # "4 5 6" -> 10 early on; "6" alone -> 20 later: the 3-gram is the better predictor
    toks = [4, 5, 6, 10, 11, 6, 20, 21, 4, 5, 6]
    assert d.propose_one(x(toks), 2) == [10, 11]
    assert NgramDrafter(1, 1).propose_one(x(toks), 2) == [20, 21]


def test_repeats_run_on_into_the_draft_itself():
    d = NgramDrafter(1, 4)
    assert d.propose_one(x([3, 1, 2, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]
    assert d.propose_one(x([8, 7, 7, 7]), 4) == [7, 7, 7, 7]


def test_no_match_no_draft_and_min_n_respected():
    assert NgramDrafter(1, 4).propose_one(x([1, 2, 3, 4]), 4) == []
    assert NgramDrafter(2, 4).propose_one(x([1, 2, 5, 2]), 4) == []  # only a 1-gram repeats


def test_incremental_index_equals_a_fresh_one_and_restarts_on_divergence():
    import random
    rng = random.Random(0)
    toks = [rng.randint(0, 5) for _ in range(200)]
    inc = NgramDrafter(1, 4)
    for n in range(1, len(toks) + 1):
        assert inc.propose_one(x(toks[:n]), 4) == NgramDrafter(1, 4).propose_one(x(toks[:n]), 4)
    other = [rng.randint(0, 5) for _ in range(50)]  # same id, tokens that do not extend the old ones
    assert inc.propose_one(x(other), 4) == NgramDrafter(1, 4).propose_one(x(other), 4)


def test_finish_drops_the_request_and_batches_keep_their_order():
    d = NgramDrafter()
    out = d.propose([x([1, 2, 1], "a"), x([5, 6, 7], "b"), x([4, 4], "c")], [2, 2, 0])
    assert [o.tokens for o in out] == [(2, 1), (), ()]
    assert set(d._index) == {"a", "b"}
    d.finish(x([1, 2, 1, 2], "a"))
    assert set(d._index) == {"b"}
