"""SuffixTrie against brute force: counts, matches and walks over random sequences."""
import random
from collections import Counter

import pytest

from mimw.engine.spec.suffix_trie import SuffixTrie


def substring_counts(seqs, depth):
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, depth + 1):
                if i + n <= len(s):
                    c[tuple(s[i:i + n])] += 1
    return c


@pytest.mark.parametrize("seed", range(4))
def test_counts_and_best_children_match_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5])
    seqs = [[rng.randint(0, 4) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    trie = SuffixTrie(depth)
    for s in seqs:
        sid = trie.add_sequence(s[:5])
        trie.extend(sid, s[5:])  # built in two pieces: extend continues where it stopped
    want = substring_counts(seqs, depth)
    assert trie.num_nodes == len(want) + 1
    for sub, n in want.items():
        node = trie.find(sub)
        assert node is not None and trie.count[node] == n
        if len(sub) < depth:
            kids = {t: want[sub + (t,)] for t in range(5) if sub + (t,) in want}
            if kids:
                assert want[sub + (trie.token_of(trie.best[node]),)] == max(kids.values())
                assert trie.followed[node] == sum(kids.values())


def test_match_is_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(6)
    trie.add_sequence([1, 2, 3, 4, 5, 9, 2, 3, 4])
    node, m = trie.match([7, 7, 2, 3, 4])
    assert m == 3 and trie.token_of(trie.best[node]) == 5
    assert trie.match([3, 4, 8]) == (0, 0)  # token 8 never occurred: no suffix matches
    # "4" occurs at the end of the sequence too, but with a continuation once: still a match
    node, m = trie.match([6, 4])
    assert m == 1 and trie.token_of(trie.best[node]) == 5


def test_walk_follows_frequency_stops_at_min_prob_and_copies_past_the_depth():
    trie = SuffixTrie(4)
    trie.add_sequence([1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 6, 7, 8])
    node = trie.find([1, 2])
    toks, probs = trie.walk(node, 5, 0.0)
    assert toks[0] == 3 and probs[0] == pytest.approx(2 / 3)  # "1 2" -> 3 twice, -> 4 once
    toks, probs = trie.walk(node, 5, 0.7)
    assert toks == []  # 2/3 < 0.7
    node = trie.find([4, 5])
    toks, probs = trie.walk(node, 5, 0.5)
    assert toks == [6, 7, 8] and probs == [1.0, 1.0, 1.0]  # depth 4 reached at "4 5 6 7": the copy goes on


def test_walk_copies_into_its_own_draft_for_the_requesters_sequence():
    trie = SuffixTrie(3)
    sid = trie.add_sequence([5, 1, 2, 1, 2, 1, 2])
    node = trie.find([1, 2])
    toks, _ = trie.walk(node, 6, 0.0, tail=trie.seqs[sid])
    assert toks == [1, 2, 1, 2, 1, 2]
