import random

import pytest

from mimw.kv.prefix import ROOT, PrefixCache, page_hash
from mimw.kv.retention import EvictionOrder, Retention


def hashes(n):
    return [page_hash(ROOT, [i]) for i in range(n)]


def drain(order):
    out = []
    while (k := order.pop()) is not None:
        out.append(k)
    return out


def test_without_retention_the_order_is_least_recently_parked_first():
    o = EvictionOrder()
    for k in "abc":
        o.add(k, None)
    o.add("a", None)  # parked again: now the most recent
    o.remove("b")
    assert len(o) == 2 and "b" not in o
    assert drain(o) == ["c", "a"] and o.pop() is None


def test_live_session_pages_go_after_all_others_recency_within_each_class():
    r = Retention("session")
    hs = hashes(4)
    o = EvictionOrder(r.rank)
    r.pin([hs[0], hs[2]])
    for i, h in enumerate(hs):
        o.add(i, h)
    assert drain(o) == [1, 3, 0, 2]


def test_unpinning_refiles_a_page_with_its_old_recency():
    r = Retention("session")
    hs = hashes(3)
    o = EvictionOrder(r.rank)
    r.subscribe(lambda h: o.refile(hs.index(h)))
    r.pin([hs[0]])
    for i, h in enumerate(hs):
        o.add(i, h)
    assert o.first(3) == [1, 2, 0]
    r.unpin([hs[0]])  # the session ended: page 0 is the oldest ordinary page again
    assert o.first(3) == [0, 1, 2] and len(o) == 3
    assert drain(o) == [0, 1, 2]


def test_pins_count_sessions_and_unpinning_too_often_is_a_bug():
    r = Retention("session")
    seen = []
    r.subscribe(seen.append)
    h = hashes(1)[0]
    r.pin([h])
    r.pin([h])  # a second session shares the page (a system prompt)
    r.unpin([h])
    assert r.is_pinned(h) and r.rank(h) == 1 and seen == [h]
    r.unpin([h])
    assert not r.is_pinned(h) and r.rank(h) == 0 and seen == [h, h]
    with pytest.raises(KeyError):
        r.unpin([h])


def test_lru_policy_ignores_sessions():
    r = Retention("lru")
    hs = hashes(3)
    o = EvictionOrder(r.rank)
    r.pin([hs[0]])
    for i, h in enumerate(hs):
        o.add(i, h)
    assert r.num_pinned == 1 and drain(o) == [0, 1, 2]
    with pytest.raises(ValueError, match="eviction policy"):
        Retention("mru")


def test_first_is_pop_without_removal_under_random_operations():
    rng = random.Random(0)
    r = Retention("session")
    hs = hashes(40)
    o = EvictionOrder(r.rank)
    r.subscribe(lambda h: o.refile(hs.index(h)))
    pinned = set()
    for _ in range(2000):
        k = rng.randrange(40)
        op = rng.random()
        if op < 0.4:
            o.add(k, hs[k])
        elif op < 0.55:
            o.remove(k)
        elif op < 0.7:
            (r.unpin if k in pinned else r.pin)([hs[k]])
            pinned ^= {k}
        elif op < 0.8:
            got = o.pop()
            assert got is None or got not in o
        else:
            n = len(o)
            ahead = o.first(5)
            assert len(o) == n and len(ahead) == min(5, n) and all(k in o for k in ahead)
    ahead = o.first(len(o))
    assert drain(o) == ahead
    # the drained order: every unpinned page before every pinned one
    ranks = [int(k in pinned) for k in ahead]
    assert ranks == sorted(ranks)


def test_prefix_cache_evicts_by_session_class_and_reports_what_it_evicts():
    r = Retention("session")
    evicted = []
    c = PrefixCache(page_size=1, retention=r, on_evict=lambda h, p: evicted.append((h, p)))
    hs = hashes(3)
    for p, h in enumerate(hs):
        c.insert(h, p)
    r.pin([hs[0]])
    for p in range(3):
        c.park(p)
    assert c.next_evicted(3) == [1, 2, 0] and c.num_parked == 3
    assert c.evict() == 1 and evicted == [(hs[1], 1)] and c.lookup(hs[1]) is None
    r.unpin([hs[0]])
    assert c.evict() == 0 and c.evict() == 2 and c.evict() is None
    assert [p for _, p in evicted] == [1, 0, 2]


class ModelOrder:
    """The order's definition, for comparison: the live keys sorted by (class, tick of their last parking)."""

    def __init__(self, rank):
        self.rank, self.tick, self.live = rank, 0, {}

    def add(self, k, h):
        self.tick += 1
        self.live[k] = (self.rank(h), self.tick, h)

    def refile(self, k):
        if k in self.live:
            _, t, h = self.live[k]
            self.live[k] = (self.rank(h), t, h)

    def keys(self):
        return [k for k, _ in sorted(self.live.items(), key=lambda kv: kv[1][:2])]

    def classes(self):
        return {k: e[0] for k, e in self.live.items()}


@pytest.mark.parametrize("seed", range(4))
def test_the_order_is_class_then_parking_order_under_random_operations(seed):
    # few keys, many operations: re-parking, removals and re-files back and forth leave stale pairs everywhere, so
    # compaction, the lists' heads and the walks that drop stale pairs all run
    rng = random.Random(seed)
    r = Retention("session")
    hs = hashes(30)
    o, m = EvictionOrder(r.rank), ModelOrder(r.rank)
    r.subscribe(lambda h: (o.refile(hs.index(h)), m.refile(hs.index(h))))
    pinned = set()
    for step in range(4000):
        k = rng.randrange(30)
        op = rng.random() * (0.7 if step // 300 % 2 else 1)  # every other 300: no pop or look (stale pairs pile up)
        v = o.version
        if op < 0.35:
            o.add(k, hs[k])
            m.add(k, hs[k])
            assert o.version != v
            pairs = sum(len(lst) - head for lst, head in zip(o._lists, o._heads))
            assert pairs <= 2 * len(o) + 64  # a growing list sheds its stale pairs: no unbounded pile
        elif op < 0.5:
            o.remove(k)
            assert (o.version != v) == (m.live.pop(k, None) is not None)
        elif op < 0.7:
            before = m.classes()
            (r.unpin if k in pinned else r.pin)([hs[k]])
            pinned ^= {k}
            assert (o.version != v) == (m.classes() != before)  # a parked page changed class
        elif op < 0.8:
            want = m.keys()[:1]
            assert [o.pop()] == (want or [None])
            m.live.pop(want[0], None) if want else None
            assert (o.version != v) == bool(want)
        else:
            n = rng.randrange(1, 12)
            assert o.first(n) == m.keys()[:n] and o.version == v  # looking ahead changes nothing
        assert len(o) == len(m.live) and all((k in o) == (k in m.live) for k in range(30))
    assert drain(o) == m.keys()


def test_looking_ahead_reads_about_as_many_pairs_as_it_returns():
    # the host tier looks at the next evictions after every step: that must not walk (or re-file) the whole pool
    o = EvictionOrder()
    for k in range(5000):
        o.add(k, None)
    for k in range(0, 200, 2):
        o.remove(k)  # stale pairs in front: the first look drops those it meets
    assert o.first(8) == [1, 3, 5, 7, 9, 11, 13, 15]
    reads = []
    live = o._is_live
    o._is_live = lambda *a: reads.append(a) or live(*a)
    assert o.first(8) == [1, 3, 5, 7, 9, 11, 13, 15] and len(reads) == 8
