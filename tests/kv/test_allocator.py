import pytest

from mimw.kv.allocator import OutOfPages, PageAllocator
from mimw.kv.prefix import PrefixCache, chain_hashes


def test_allocate_and_release_round_trip():
    a = PageAllocator(4)
    pages = a.allocate(3)
    assert sorted(pages) == [0, 1, 2] and a.num_in_use == 3 and a.num_available == 1
    a.release(pages)
    assert a.num_in_use == 0 and a.num_free == 4


def test_out_of_pages_changes_nothing():
    a = PageAllocator(2)
    a.allocate(1)
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert a.num_available == 1 and a.num_in_use == 1


def test_double_free_and_sharing_a_free_page_are_errors():
    a = PageAllocator(2)
    [p] = a.allocate(1)
    a.release([p])
    with pytest.raises(ValueError, match="double free"):
        a.release([p])
    with pytest.raises(ValueError, match="free"):
        a.share([p])


def test_registered_pages_park_instead_of_freeing_and_are_evicted_last():
    prefix = PrefixCache(page_size=2)
    a = PageAllocator(3, prefix)
    pages = a.allocate(2)
    hs = chain_hashes([1, 2, 3, 4], 2)
    assert prefix.insert(hs[0], pages[0]) and prefix.insert(hs[1], pages[1])
    a.release(pages)
    assert a.num_free == 1 and a.num_parked == 2 and a.num_in_use == 0 and a.num_available == 3
    # the free page goes first; then the least recently released parked page (pages[0]) is evicted
    [p] = a.allocate(1)
    assert p not in pages
    [q] = a.allocate(1)
    assert q == pages[0] and prefix.match(hs) == []  # the chain is broken at its first page
    assert a.refcount(q) == 1


def test_share_takes_a_parked_page_out_of_the_lru():
    prefix = PrefixCache(page_size=2)
    a = PageAllocator(2, prefix)
    [p] = a.allocate(1)
    h = chain_hashes([7, 7], 2)[0]
    prefix.insert(h, p)
    a.release([p])
    assert a.num_parked == 1
    a.share(prefix.match([h]))
    assert a.refcount(p) == 1 and a.num_parked == 0 and a.num_available == 1
    a.share([p])  # a second reader
    a.release([p])
    assert a.refcount(p) == 1 and a.num_parked == 0
    a.release([p])
    assert a.num_parked == 1 and a.num_free == 1
