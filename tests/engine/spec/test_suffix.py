"""SuffixDecoding drafter: own history, the session's earlier requests, adaptive length, bounded sessions."""
import pytest

from mimw.engine.sampling import SamplingParams
from mimw.engine.spec.drafter import DraftInput
from mimw.engine.spec.suffix import SuffixConfig, SuffixDrafter

P = SamplingParams(temperature=0)


def x(tokens, rid="r", session=None, prompt=1):
    return DraftInput(rid, list(tokens), prompt, P, session)


def test_own_history_drafts_the_repeated_text():
    d = SuffixDrafter(SuffixConfig(depth=8, max_match=4, spec_factor=4.0))
    code = list(range(100, 120))
    toks = code + [7, 7] + code[:6]
    assert d.propose_one(x(toks), 8) == code[6:14]


def test_draft_length_grows_with_the_match_length():
    d = SuffixDrafter(SuffixConfig(depth=12, max_match=8, spec_factor=1.0, spec_offset=0.0))
    code = list(range(100, 130))
    assert len(d.propose_one(x(code + [1] + code[:2], "a"), 16)) == 2  # 2-token match -> 2 tokens
    assert len(d.propose_one(x(code + [1] + code[:6], "b"), 16)) == 6


def test_frequency_and_min_prob_decide_how_far_to_trust_a_context():
    # "5 6" was followed by 1 three times and by 2 once: drafting 1 is 75% likely, 1 then 9 too
    toks = [5, 6, 1, 9, 5, 6, 1, 9, 5, 6, 2, 8, 5, 6, 1, 9, 0, 5, 6]
    assert SuffixDrafter(SuffixConfig(depth=6, max_match=2, min_prob=0.5)).propose_one(x(toks), 4)[:2] == [1, 9]
    assert SuffixDrafter(SuffixConfig(depth=6, max_match=2, min_prob=0.8)).propose_one(x(toks), 4) == []


def test_session_history_drafts_for_a_later_request_of_the_same_session():
    d = SuffixDrafter(SuffixConfig(depth=10, max_match=6, spec_factor=4.0, global_tokens=0))
    answer = list(range(200, 230))
    first = x([1, 2, 3] + answer, "a", session="s", prompt=3)
    d.propose_one(first, 4)
    d.finish(first)
    later = [9, 9] + answer[:5]
    assert d.propose_one(x(later, "b", session="s"), 8) == answer[5:13]
    assert d.propose_one(x(later, "c", session="other"), 8) == []
    assert d.propose_one(x(later, "d"), 8) == []  # no global trie: only the session shares


def test_the_global_trie_drafts_from_any_earlier_request_and_is_bounded():
    d = SuffixDrafter(SuffixConfig(depth=10, max_match=6, spec_factor=4.0, global_tokens=64, lead_in=0))
    answer = list(range(200, 230))
    d.finish(x([1, 2, 3] + answer, "a", prompt=3))  # no session
    later = [9, 9] + answer[:5]
    assert d.propose_one(x(later, "b"), 8) == answer[5:13]
    assert d.propose_one(x(later, "c", session="other"), 8) == answer[5:13]
    # the continuation seen most often wins (three times in the session and the global trie, against once)
    mine = answer[:5] + [7] * 20
    for i in range(3):
        d.finish(x([0] + mine, f"m{i}", session="s", prompt=1))
    assert d.propose_one(x(later, "e", session="s"), 4) == [7, 7, 7, 7]
    for i in range(20):  # 600 more tokens of unrelated history: the first answer falls out of the bound
        d.finish(x([0] + list(range(1000 + 30 * i, 1030 + 30 * i)), f"f{i}", prompt=1))
    assert d.propose_one(x(later, "g"), 8) == []
    with pytest.raises(ValueError):
        SuffixConfig(global_tokens=-1)


def test_sessions_are_bounded_in_tokens_and_count():
    d = SuffixDrafter(SuffixConfig(depth=4, max_match=2, session_tokens=50, max_sessions=2, lead_in=0))
    for i in range(10):
        d.finish(x([0] + list(range(i * 30, i * 30 + 30)), f"r{i}", session="s"))
        assert d.session_tokens("s") <= 2 * 50
    assert d.session_tokens("s") >= 30
    d.finish(x([0, 1], "t", session="t"))
    d.finish(x([0, 1], "u", session="u"))
    assert d.num_sessions == 2 and d.session_tokens("s") == 0  # the least recently used went


def test_config_is_validated():
    with pytest.raises(ValueError):
        SuffixConfig(depth=4, max_match=4)
    with pytest.raises(ValueError):
        SuffixConfig(min_prob=1.5)


def test_shared_history_rotates_generations_instead_of_rebuilding():
    from mimw.engine.spec.suffix import _Session

    s = _Session(depth=4)
    s.add([1, 2, 3], cap=5)
    first = s.new
    s.add([4, 5], cap=5)
    assert s.new is first and s.old is None and s.tokens == 5
    s.add([6], cap=5)  # the newer generation is full: it becomes the older one, as it is
    assert s.old is first and s.new is not first and (s.old_tokens, s.new_tokens) == (5, 1)
    s.add([7, 8, 9, 10, 11], cap=5)  # full again: the first generation is dropped whole
    assert s.old is not first and s.tokens == 6 and all(t.num_tokens == n for t, n in zip(s.tries, (5, 1)))
