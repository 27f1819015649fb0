"""HostKVTier on the CPU: offload on eviction, restore, backup, its bound and eviction order, async ordering."""
import os

import pytest
import torch

from mimw.kv.allocator import PageAllocator
from mimw.kv.host_tier import HostKVTier
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.kv.prefix import ROOT, PrefixCache, page_hash
from mimw.kv.retention import Retention
from mimw.kv.transfer import DeferredCopier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=2, num_pages=4, dtype=torch.float32)


class ScaledCache(PagedKVCache):
    """A cache with one more per-page tensor (like FP8 scales): the tier must move it with the page."""

    def __init__(self, layout, device="cpu"):
        super().__init__(layout, device)
        self.scale = torch.zeros(layout.num_layers, layout.num_pages, layout.num_kv_heads)

    def page_tensors(self):
        return (self.k, self.v, self.scale)


def stack(host_pages=3, policy="session", copier=None, cache_cls=PagedKVCache):
    cache = cache_cls(LAYOUT)
    ret = Retention(policy)
    host = HostKVTier(cache, host_pages, ret, copier)
    prefix = PrefixCache(LAYOUT.page_size, ret, on_evict=host.on_device_evict)
    return cache, ret, host, prefix, PageAllocator(LAYOUT.num_pages, prefix)


def fill(cache, page, value):
    for t in cache.page_tensors():
        t[:, page] = value + torch.arange(t[:, page].numel(), dtype=t.dtype).view(t[:, page].shape) / 1000


def park_new(alloc, prefix, cache, names, value0=0.0):
    """Allocate a page per name, fill it, register it, release it (parked); returns (hashes, pages)."""
    hs = [page_hash(ROOT, [n]) for n in names]
    pages = alloc.allocate(len(hs))
    for i, (h, p) in enumerate(zip(hs, pages)):
        fill(cache, p, value0 + i)
        assert prefix.insert(h, p)
    alloc.release(pages)
    return hs, pages


def snapshot(cache, page):
    return [t[:, page].clone() for t in cache.page_tensors()]


def same(cache, page, snap):
    return all(torch.equal(t[:, page], s) for t, s in zip(cache.page_tensors(), snap))


@pytest.mark.parametrize("cache_cls", [PagedKVCache, ScaledCache])
def test_evicted_pages_go_to_the_host_and_come_back_bit_exact(cache_cls):
    cache, _, host, prefix, alloc = stack(cache_cls=cache_cls)
    hs, pages = park_new(alloc, prefix, cache, [1, 2, 3, 4])
    snaps = {h: snapshot(cache, p) for h, p in zip(hs, pages)}
    taken = alloc.allocate(4)  # evicts all four: each is offloaded first
    for p in taken:
        fill(cache, p, -50.0)  # the new owners overwrite them
    assert [prefix.lookup(h) for h in hs] == [None] * 4
    assert host.stats().pages_used == 3 and host.stats().pages_offloaded == 4  # bounded: the oldest went
    assert host.lookup(hs[0]) is None and all(host.lookup(h) is not None for h in hs[1:])
    alloc.release(taken)
    host.hold(hs[1:])
    fresh = alloc.allocate(3)
    t = host.restore(hs[1:], fresh)
    assert t.done() and host.ready(fresh)
    for h, p in zip(hs[1:], fresh):
        assert same(cache, p, snaps[h])
    assert host.stats().bytes_to_device == 3 * host.page_bytes == t.nbytes


def test_the_host_keeps_live_session_pages_and_refuses_ordinary_pages_when_full_of_them():
    cache, ret, host, prefix, alloc = stack(host_pages=2)
    hs, _ = park_new(alloc, prefix, cache, [1, 2, 3, 4])
    ret.pin(hs[:2])  # a live session holds pages 0 and 1
    alloc.allocate(4)  # evicts 2, 3 (ordinary pages) first, then 0, 1
    assert host.stats().pages_used == 2
    assert host.lookup(hs[0]) is not None and host.lookup(hs[1]) is not None  # ordinary ones were pushed out
    ret.unpin(hs[:2])
    assert host.index.next_evicted(2) == [host.lookup(hs[0]), host.lookup(hs[1])]


def test_lru_policy_host_keeps_the_most_recently_evicted():
    cache, ret, host, prefix, alloc = stack(host_pages=2, policy="lru")
    hs, _ = park_new(alloc, prefix, cache, [1, 2, 3, 4])
    ret.pin(hs[:2])  # ignored under lru
    alloc.allocate(4)
    assert [host.lookup(h) is not None for h in hs] == [False, False, True, True]


def test_backup_copies_the_next_evictions_ahead_and_eviction_then_costs_no_copy():
    cache, _, host, prefix, alloc = stack(host_pages=4)
    hs, pages = park_new(alloc, prefix, cache, [1, 2, 3, 4])
    assert host.backup(prefix, 2) == 2 and host.stats().pages_offloaded == 2
    assert prefix.num_parked == 4  # still cached on the device
    assert host.backup(prefix, 2) == 0  # already there
    alloc.allocate(2)
    assert host.stats().pages_offloaded == 2  # evicting them copied nothing more
    assert [host.lookup(h) is not None for h in hs] == [True, True, False, False]


def test_backup_looks_at_the_device_order_again_only_when_something_moved():
    # the engine calls backup after every step: a decode step that parks, evicts and offloads nothing must not walk
    # the next evictions again
    cache, ret, host, prefix, alloc = stack(host_pages=3)
    looks = []
    ahead = prefix.next_evicted
    prefix.next_evicted = lambda n: looks.append(n) or ahead(n)
    hs, pages = park_new(alloc, prefix, cache, [1, 2])
    assert host.backup(prefix, 3) == 2 and len(looks) == 1
    assert host.backup(prefix, 3) == 0 and len(looks) == 2  # it copied: what the host holds moved, look again
    assert host.backup(prefix, 3) == 0 and host.backup(prefix, 2) == 0 and len(looks) == 2  # all there, no move
    assert host.backup(prefix, 4) == 0 and len(looks) == 3  # a wider window is a new question
    (p,) = alloc.allocate(1)  # a free page: the order does not move
    assert host.backup(prefix, 3) == 0 and len(looks) == 3
    assert prefix.insert(page_hash(ROOT, [3]), p)
    alloc.release([p])  # parked: the order moved
    assert host.backup(prefix, 3) == 1 and len(looks) == 4 and host.lookup(page_hash(ROOT, [3])) is not None
    assert host.backup(prefix, 3) == 0 and host.backup(prefix, 3) == 0 and len(looks) == 5
    alloc.share([pages[0]])  # a prefix hit takes a parked page back: the order moved
    assert host.backup(prefix, 3) == 0 and host.backup(prefix, 3) == 0 and len(looks) == 6
    ret.pin([hs[1]])  # a session pins a parked page: it changes class
    assert host.backup(prefix, 3) == 0 and host.backup(prefix, 3) == 0 and len(looks) == 7


def test_async_offload_of_a_reused_page_is_fenced_before_the_new_owner_writes():
    copier = DeferredCopier()
    cache, _, host, prefix, alloc = stack(copier=copier)
    hs, pages = park_new(alloc, prefix, cache, [1])
    snap = snapshot(cache, pages[0])
    taken = alloc.allocate(4)  # the three free pages, then page 0 evicted: its offload is issued, not run
    p = taken[-1]
    assert p == pages[0] and copier.num_pending == 1
    host.fence()  # what the engine does before the step that writes p
    fill(cache, p, 99.0)
    hp = host.lookup(hs[0])
    assert all(torch.equal(t[hp], s) for t, s in zip(host.tensors, snap))


def test_async_restore_holds_the_pages_until_the_copy_has_run():
    copier = DeferredCopier()
    cache, _, host, prefix, alloc = stack(copier=copier)
    hs, pages = park_new(alloc, prefix, cache, [1, 2])
    snaps = [snapshot(cache, p) for p in pages]
    alloc.release(alloc.allocate(4))  # evict both; the offloads are pending
    host.hold(hs)
    fresh = alloc.allocate(2)
    t = host.restore(hs, fresh)
    assert not host.ready(fresh) and not t.done()
    copier.run(1)  # the offloads ran, the restore has not
    assert not host.ready(fresh)
    copier.run()
    assert host.ready(fresh) and t.done()
    assert all(same(cache, p, s) for p, s in zip(fresh, snaps))


def test_held_pages_survive_offloads_that_fill_the_host():
    cache, _, host, prefix, alloc = stack(host_pages=2)
    hs, _ = park_new(alloc, prefix, cache, [1, 2])
    alloc.release(alloc.allocate(4))  # both in the host now
    host.hold(hs)
    more, _ = park_new(alloc, prefix, cache, [5, 6], value0=10.0)
    alloc.allocate(4)  # offloads 5 and 6 into a full host whose pages are all held: nothing to evict
    assert host.lookup(hs[0]) is not None and host.lookup(hs[1]) is not None
    assert host.lookup(more[0]) is None and host.lookup(more[1]) is None


def test_for_bytes_sizes_the_pool_from_every_per_page_tensor():
    cache = ScaledCache(LAYOUT)
    per_page = sum(t[:, 0].numel() * t.element_size() for t in cache.page_tensors())
    assert HostKVTier.for_bytes(cache, 5 * per_page + 1).num_pages == 5
    with pytest.raises(ValueError, match="holds no page"):
        HostKVTier.for_bytes(cache, per_page - 1)


def test_for_bytes_refuses_a_pool_past_the_memory_the_machine_has_available(monkeypatch):
    """A pinned pool larger than the machine's available memory fails as "CUDA out of memory" (or swaps): refused
    up front, naming both sizes."""
    from mimw.kv import host_tier

    cache = ScaledCache(LAYOUT)
    per_page = sum(t[:, 0].numel() * t.element_size() for t in cache.page_tensors())
    monkeypatch.setattr(host_tier, "available_host_bytes", lambda: 4 * per_page)
    assert HostKVTier.for_bytes(cache, 4 * per_page).num_pages == 4
    with pytest.raises(ValueError, match="does not fit the .* GiB of memory this machine has available"):
        HostKVTier.for_bytes(cache, 5 * per_page)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="MemAvailable is Linux's /proc/meminfo")
def test_available_host_bytes_reads_memavailable():
    from mimw.kv.host_tier import available_host_bytes

    with open("/proc/meminfo") as f:
        line = next(ln for ln in f if ln.startswith("MemAvailable:"))
    free = available_host_bytes()
    assert free is not None and free % 1024 == 0
    assert abs(free - int(line.split()[1]) * 1024) < 2**30  # read a moment apart


def test_a_restore_waits_for_the_offload_that_writes_its_host_page():
    copier = DeferredCopier()
    cache, _, host, prefix, alloc = stack(copier=copier)
    hs, pages = park_new(alloc, prefix, cache, [1])
    snap = snapshot(cache, pages[0])
    alloc.allocate(4)  # page 0 evicted: its offload is pending
    alloc.release(range(4))
    host.hold(hs)
    [fresh] = alloc.allocate(1)
    t = host.restore(hs, [fresh])
    copier.fence([t])  # run the restore as soon as it may: after the offload it depends on
    assert copier.num_pending == 0 and same(cache, fresh, snap)


def test_an_offload_into_a_host_page_waits_for_the_restore_reading_it():
    copier = DeferredCopier()
    cache, _, host, prefix, alloc = stack(host_pages=1, copier=copier)
    hs, pages = park_new(alloc, prefix, cache, [1])
    snap = snapshot(cache, pages[0])
    alloc.release(alloc.allocate(4))  # page 0 offloaded into the only host page
    copier.run()
    host.hold(hs)
    [fresh] = alloc.allocate(1)
    t_restore = host.restore(hs, [fresh])  # pending: still has to read the host page
    more, _ = park_new(alloc, prefix, cache, [2], value0=40.0)
    alloc.allocate(3)  # evicts page "2": its offload reuses the host page the restore reads
    assert host.lookup(more[0]) is not None and host.lookup(hs[0]) is None
    t_off = host._host_last[0]
    assert t_off is not t_restore
    copier.fence([t_off])
    assert t_restore.done() and same(cache, fresh, snap)
