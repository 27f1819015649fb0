from mimw.kv.prefix import ROOT, PrefixCache, chain_hashes, page_hash


def test_hash_chain_depends_on_every_earlier_token():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial page (token 7) gets no hash
    b = chain_hashes([9, 2, 3, 4, 5, 6], 2)
    # page 1 holds the same tokens (3, 4) but follows a different page 0, so it has a different name
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] == page_hash(ROOT, [1, 2]) and a[1] == page_hash(a[0], [3, 4])


def test_chain_hashes_extends_a_known_prefix_in_place():
    known = chain_hashes([1, 2], 2)
    out = chain_hashes([1, 2, 3, 4], 2, known)
    assert out is known and out == chain_hashes([1, 2, 3, 4], 2)


def test_chain_hashes_stops_at_num_pages_and_hashes_each_page_once():
    toks = list(range(10))
    assert chain_hashes(toks, 2, num_pages=3) == chain_hashes(toks[:6], 2)
    assert chain_hashes(toks, 2, num_pages=9) == chain_hashes(toks, 2)  # at most the full pages there are
    known = chain_hashes(toks, 2, num_pages=2)
    marker = known[1] = b"already known"  # a known page is never recomputed
    assert chain_hashes(toks, 2, known, num_pages=4)[1] is marker and len(known) == 4


def test_match_returns_longest_cached_prefix():
    c = PrefixCache(page_size=2)
    hs = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    c.insert(hs[0], 10)
    c.insert(hs[1], 11)
    assert c.match(hs) == [10, 11]
    assert c.match(chain_hashes([1, 2, 0, 0], 2)) == [10]
    assert c.match(chain_hashes([0, 2], 2)) == []


def test_first_writer_wins():
    c = PrefixCache(page_size=2)
    h = chain_hashes([1, 2], 2)[0]
    assert c.insert(h, 3)
    assert not c.insert(h, 4)  # duplicate content stays private to its writer
    assert not c.insert(chain_hashes([5, 6], 2)[0], 3)  # a page has one name
    assert c.match([h]) == [3] and not c.is_registered(4)


def test_lru_evicts_oldest_release_and_forgets_its_hash():
    c = PrefixCache(page_size=1)
    hs = [page_hash(ROOT, [t]) for t in range(3)]
    for p, h in enumerate(hs):
        c.insert(h, p)
    assert not c.park(99)  # unregistered: the caller frees it
    c.park(0), c.park(1), c.park(2)
    c.unpark(0)
    c.park(0)  # released again: now the most recent
    assert c.evict() == 1 and c.match([hs[1]]) == []
    assert c.evict() == 2 and c.evict() == 0 and c.evict() is None
    assert c.num_registered == 0


def test_hit_rate():
    c = PrefixCache(page_size=4)
    assert c.hit_rate == 0.0
    c.record_lookup(10, 0)
    c.record_lookup(10, 8)
    assert c.hit_rate == 0.4
