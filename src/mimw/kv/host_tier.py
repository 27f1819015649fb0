"""HostKVTier: a second, larger pool of KV pages in host memory, behind the device pool's prefix cache.

What it holds: copies of full, hashed prefix pages (``mimw.kv.prefix``), indexed by the same chain hashes in their
own ``PrefixCache`` (every host page is evictable; the order follows the same ``Retention`` as the device pool, so
pages of live sessions stay longest). Capacity is fixed at construction; a full pool evicts its first page in
that order to make room.

How pages move (``mimw.kv.transfer`` does the copies, asynchronously on a GPU):
  * offload: when the device prefix cache evicts a page (``on_device_evict``), its contents go to a host page
    unless the host already holds that hash. To keep that copy off the critical path, ``backup`` copies the pages
    that the next evictions will take ahead of time, while they are still parked on the device.
  * restore: a request whose prefix continues in host pages gets fresh device pages and one restore batch
    (``restore``); the scheduler holds that request (only it) until ``ready`` says its pages have arrived.

Ordering rules (what makes the copies safe without ever blocking the host):
  * A batch is issued after the compute work that wrote its source pages (``CudaCopier`` waits on the compute
    stream) and after the unfinished batches that last touched any of its pages, device or host (``after``): a
    page is never read before the copy writing it, nor overwritten before the copy reading it, in either
    direction. Offloads and restores otherwise run independently.
  * A device page with an unfinished copy that is handed to a new owner (evicted, then reallocated) puts that copy
    on the fence list; ``fence`` (called before every step) makes the compute stream wait for it.
  * A device page being restored is read by no step before ``ready`` reports it: the scheduler checks every
    admitted request's pages.
Not thread-safe: the engine thread owns it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .pages import PagedKVCache
from .prefix import PrefixCache
from .retention import Retention
from .transfer import PageCopier, Transfer, copier_for


@dataclass(frozen=True)
class HostTierStats:
    pages_total: int
    pages_used: int
    bytes_to_host: int
    bytes_to_device: int
    pages_offloaded: int
    pages_restored: int


def available_host_bytes() -> int | None:
    """The memory the kernel reports available for new allocations (``MemAvailable`` in /proc/meminfo), or None
    where that file does not exist (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostKVTier:
    def __init__(self, cache: PagedKVCache, num_pages: int, retention: Retention | None = None,
                 copier: PageCopier | None = None, pin_memory: bool | None = None):
        if num_pages <= 0:
            raise ValueError(f"the host tier needs at least one page, got {num_pages}")
        self.cache = cache
        self.num_pages = num_pages
        self.copier = copier or copier_for(cache.device)
        self._rank = retention.rank if retention is not None else (lambda h: 0)
        pin = cache.device.type == "cuda" if pin_memory is None else pin_memory
        # host page i of tensor j holds what device page p holds in cache.page_tensors()[j][:, p]
        self.tensors = tuple(torch.empty((num_pages, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
                             for t in cache.page_tensors())
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.index = PrefixCache(cache.layout.page_size, retention)
        self._free = list(range(num_pages - 1, -1, -1))
        self._loading: dict[int, Transfer] = {}  # device page -> the restore writing it, until done
        self._device_last: dict[int, Transfer] = {}  # device page -> the last unfinished copy touching it
        self._host_last: dict[int, Transfer] = {}  # host page -> the last unfinished copy touching it
        self._fence: list[Transfer] = []  # copies the next step's compute must wait for
        # (device cache, its order_version, pages_offloaded, n) of the last backup that found all n pages here
        self._all_backed: tuple | None = None
        self.bytes_to_host = self.bytes_to_device = self.pages_offloaded = self.pages_restored = 0

    @classmethod
    def for_bytes(cls, cache: PagedKVCache, capacity_bytes: int, retention: Retention | None = None,
                  copier: PageCopier | None = None) -> "HostKVTier":
        per_page = sum(t[:, 0].numel() * t.element_size() for t in cache.page_tensors())
        num_pages = capacity_bytes // per_page
        if num_pages <= 0:
            raise ValueError(f"a host tier of {capacity_bytes} bytes holds no page ({per_page} bytes per page)")
        free = available_host_bytes()
        if free is not None and num_pages * per_page > free:  # a pinned allocation past it fails as "CUDA out of
            # memory", or the machine swaps
            raise ValueError(f"a host KV tier of {num_pages * per_page / 2**30:.1f} GiB does not fit the "
                             f"{free / 2**30:.1f} GiB of memory this machine has available (MemAvailable)")
        return cls(cache, num_pages, retention, copier)

    # --- queries -------------------------------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        """The host page holding the page named ``h``, if any."""
        return self.index.lookup(h)

    def ready(self, pages: Sequence[int]) -> bool:
        """True when no device page of ``pages`` still waits for a restore."""
        for p in pages:
            t = self._loading.get(p)
            if t is not None:
                if not t.done():
                    return False
                del self._loading[p]
        return True

    def stats(self) -> HostTierStats:
        return HostTierStats(self.num_pages, self.index.num_registered, self.bytes_to_host, self.bytes_to_device,
                             self.pages_offloaded, self.pages_restored)

    # --- moves ---------------------------------------------------------------------------------------------
    def on_device_evict(self, h: bytes, page: int) -> None:
        """The device prefix cache is handing ``page`` (named ``h``) to a new owner: keep its contents here."""
        if self.index.lookup(h) is None:
            self._offload([(h, page)])
        else:
            self.index.park(self.index.lookup(h))  # evicted from the device: now the most recent host copy
        self._loading.pop(page, None)
        t = self._device_last.get(page)
        if t is not None and not t.done():
            self._fence.append(t)  # the new owner's first write waits for this copy

    def backup(self, device_prefix: PrefixCache, n: int) -> int:
        """Copy to the host the next ``n`` device pages the device cache would evict, where the host lacks them
        (a write-behind: their eviction then costs no copy). Returns how many pages were copied.

        Called after every step, it looks at those pages only when something moved since a look that found them
        all on the host: the device order (``order_version``), what the host holds (only ``_offload`` changes
        that, counting ``pages_offloaded``) or a larger ``n``. In a decode step that allocates no page, nothing
        did."""
        seen = (device_prefix, device_prefix.order_version, self.pages_offloaded)
        if self._all_backed is not None and self._all_backed[:3] == seen and n <= self._all_backed[3]:
            return 0
        items = []
        for p in device_prefix.next_evicted(n):
            h = device_prefix.hash_of(p)
            if h is not None and self.index.lookup(h) is None and p not in self._loading:
                items.append((h, p))
        # (with restores in flight a page may leave ``_loading`` unseen: look again next time)
        self._all_backed = (*seen, n) if not items and not self._loading else None
        self._offload(items)
        return len(items)

    def hold(self, hashes: Sequence[bytes]) -> None:
        """Keep the host pages named ``hashes`` from eviction until ``restore`` copies them (the caller allocates
        their device pages in between, which may offload other pages here)."""
        for h in hashes:
            self.index.unpark(self.index.lookup(h))

    def restore(self, hashes: Sequence[bytes], pages: Sequence[int]) -> Transfer:
        """Copy the host pages named ``hashes`` (held by ``hold``) into device ``pages`` (fresh, owned by the
        caller, registered by it in the device prefix cache). The caller waits for ``ready(pages)`` before a step
        reads them."""
        host_pages = []
        for h in hashes:
            hp = self.index.lookup(h)
            if hp is None:
                raise KeyError("restore of a page the host tier does not hold")
            self.index.park(hp)  # evictable again, as the most recent of its class
            host_pages.append(hp)
        t = self.copier.restore(self.tensors, host_pages, self.cache.page_tensors(), list(pages),
                                after=self._after(pages, host_pages))
        self.bytes_to_device += t.nbytes
        self.pages_restored += len(host_pages)
        self._track(t, pages, host_pages)
        if not t.done():
            for p in pages:
                self._loading[p] = t
        return t

    def fence(self) -> None:
        """Called before a step: the step's compute waits (on the device) for copies of pages it may overwrite."""
        if self._fence:
            self.copier.fence(self._fence)
            self._fence.clear()

    def poll(self) -> None:
        """Forget finished copies."""
        for pending in (self._loading, self._device_last, self._host_last):
            for p in [p for p, t in pending.items() if t.done()]:
                del pending[p]

    # --- internals -----------------------------------------------------------------------------------------
    def _offload(self, items: list[tuple[bytes, int]]) -> None:
        items = items[-self.num_pages:]  # a batch larger than the pool keeps its last pages
        if not items:
            return
        host_pages, pages = [], []
        for h, p in items:
            if not self._free:
                victim = self.index.next_evicted(1)
                if not victim or self._rank(h) < self._rank(self.index.hash_of(victim[0])):
                    continue  # nothing evictable, or it would be the first page evicted: keep what is there
            hp = self._free.pop() if self._free else self.index.evict()
            assert hp is not None
            self.index.insert(h, hp)
            self.index.park(hp)
            host_pages.append(hp)
            pages.append(p)
        if not pages:
            return
        t = self.copier.offload(self.cache.page_tensors(), pages, self.tensors, host_pages,
                                after=self._after(pages, host_pages))
        self.bytes_to_host += t.nbytes
        self.pages_offloaded += len(pages)
        self._track(t, pages, host_pages)

    def _after(self, pages: Sequence[int], host_pages: Sequence[int]) -> list[Transfer]:
        """The unfinished copies that last touched any of these pages: a new copy of them runs after those."""
        out: dict[int, Transfer] = {}
        for last, keys in ((self._device_last, pages), (self._host_last, host_pages)):
            for k in keys:
                t = last.get(k)
                if t is not None and not t.done():
                    out[id(t)] = t
        return list(out.values())

    def _track(self, t: Transfer, pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if not t.done():
            for p in pages:
                self._device_last[p] = t
            for hp in host_pages:
                self._host_last[hp] = t
