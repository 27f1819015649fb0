"""Page copies between the device KV pool and the host tier's pool, in batches that complete asynchronously.

The two pools hold the same per-page tensors (``PagedKVCache.page_tensors``: K, V and whatever else a page
carries, such as FP8 scales), laid out differently:

    device pool: t[layer, page, ...]        one tensor per entry of page_tensors()
    host pool:   t[page, layer, ...]        host page i is one contiguous block, so one DMA moves a page

A ``PageCopier`` issues a batch (``offload``: device pages -> host pages, ``restore``: host -> device) and returns
a ``Transfer`` whose ``done()`` says whether it has completed. Three implementations, one contract:

  * ``SyncCopier``: copies at once (a CPU-only engine, where both pools are host memory); ``done()`` is True.
  * ``CudaCopier``: one copy stream per device. A batch first waits (on the GPU) for the compute work already
    issued, so it reads what the earlier steps wrote; ``done()`` queries its CUDA event; ``fence`` makes the
    compute stream wait for a batch before the next step touches pages it reads or writes. The host never blocks.
  * ``DeferredCopier``: runs each batch later, when the caller says (``run``), reading the source then: a CPU
    model of an asynchronous copy that tests use to check that nothing reads a page before its copy is done or
    overwrites it while a copy still has to read it.

Batches run in issue order on every implementation (one stream), so two batches that touch the same host page
never race; only the compute stream needs explicit ordering (``fence``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Sequence

import torch


class Transfer:
    """One issued batch of page copies."""

    def __init__(self, nbytes: int, event: "torch.cuda.Event | None" = None, keep: tuple = ()):
        self.nbytes = nbytes
        self._event = event
        self._keep = keep  # staging tensors the copy still reads or writes (released when done)
        self._done = event is None

    def done(self) -> bool:
        if not self._done and self._event is not None and self._event.query():
            self._done, self._keep = True, ()
        return self._done


class PageCopier(ABC):
    @abstractmethod
    def offload(self, device: Sequence[torch.Tensor], pages: Sequence[int], host: Sequence[torch.Tensor],
                host_pages: Sequence[int]) -> Transfer:
        """Copy device ``pages`` into ``host_pages`` (same order) of every tensor pair."""

    @abstractmethod
    def restore(self, host: Sequence[torch.Tensor], host_pages: Sequence[int], device: Sequence[torch.Tensor],
                pages: Sequence[int]) -> Transfer:
        """Copy ``host_pages`` into device ``pages`` (same order) of every tensor pair."""

    def fence(self, transfers: Sequence[Transfer]) -> None:
        """Order the compute work issued from now on after ``transfers`` (without blocking the host)."""


def _offload_now(device: Sequence[torch.Tensor], pages: Sequence[int], host: Sequence[torch.Tensor],
                 host_pages: Sequence[int], non_blocking: bool) -> list[torch.Tensor]:
    keep = []
    for d, h in zip(device, host):
        idx = torch.tensor(list(pages), dtype=torch.long).to(d.device, non_blocking=True)
        staged = d.index_select(1, idx).transpose(0, 1).contiguous()  # [n, layers, ...] on the device
        for i, hp in enumerate(host_pages):
            h[hp].copy_(staged[i], non_blocking=non_blocking)
        keep.append(staged)
    return keep


def _restore_now(host: Sequence[torch.Tensor], host_pages: Sequence[int], device: Sequence[torch.Tensor],
                 pages: Sequence[int], non_blocking: bool) -> list[torch.Tensor]:
    keep = []
    for h, d in zip(host, device):
        staged = torch.empty((len(pages), *h.shape[1:]), dtype=h.dtype, device=d.device)
        for i, hp in enumerate(host_pages):
            staged[i].copy_(h[hp], non_blocking=non_blocking)
        idx = torch.tensor(list(pages), dtype=torch.long).to(d.device, non_blocking=True)
        d.index_copy_(1, idx, staged.transpose(0, 1))
        keep.append(staged)
    return keep


def _nbytes(tensors: Sequence[torch.Tensor], n: int) -> int:
    """Bytes of ``n`` pages of ``tensors`` laid out [layer, page, ...]."""
    return n * sum(t[:, 0].numel() * t.element_size() for t in tensors)


class SyncCopier(PageCopier):
    def offload(self, device, pages, host, host_pages) -> Transfer:
        _offload_now(device, pages, host, host_pages, non_blocking=False)
        return Transfer(_nbytes(device, len(pages)))

    def restore(self, host, host_pages, device, pages) -> Transfer:
        _restore_now(host, host_pages, device, pages, non_blocking=False)
        return Transfer(_nbytes(device, len(pages)))


class CudaCopier(PageCopier):
    """Copies on a dedicated stream of ``device``; the host pool must be pinned for the copies to be async."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _issue(self, run: Callable[[], list[torch.Tensor]], nbytes: int) -> Transfer:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # read what the steps issued so far wrote
        with torch.cuda.stream(self.stream):
            keep = run()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Transfer(nbytes, event, tuple(keep))

    def offload(self, device, pages, host, host_pages) -> Transfer:
        return self._issue(lambda: _offload_now(device, pages, host, host_pages, non_blocking=True),
                           _nbytes(device, len(pages)))

    def restore(self, host, host_pages, device, pages) -> Transfer:
        return self._issue(lambda: _restore_now(host, host_pages, device, pages, non_blocking=True),
                           _nbytes(device, len(pages)))

    def fence(self, transfers: Sequence[Transfer]) -> None:
        compute = torch.cuda.current_stream(self.device)
        for t in transfers:
            if not t.done() and t._event is not None:
                compute.wait_event(t._event)


class _Deferred(Transfer):
    def __init__(self, nbytes: int):
        super().__init__(nbytes, None)
        self._done = False


class DeferredCopier(PageCopier):
    """Runs each batch only when ``run`` (or a ``fence`` on it) says so, in issue order; a batch reads its source
    when it runs, as a DMA engine would."""

    def __init__(self):
        self._queue: deque[tuple[_Deferred, Callable[[], object]]] = deque()

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    def run(self, n: int | None = None) -> None:
        """Complete the ``n`` oldest pending batches (all when None)."""
        for _ in range(len(self._queue) if n is None else min(n, len(self._queue))):
            t, work = self._queue.popleft()
            work()
            t._done = True

    def _defer(self, work: Callable[[], object], nbytes: int) -> Transfer:
        t = _Deferred(nbytes)
        self._queue.append((t, work))
        return t

    def offload(self, device, pages, host, host_pages) -> Transfer:
        pages, host_pages = list(pages), list(host_pages)
        return self._defer(lambda: _offload_now(device, pages, host, host_pages, False), _nbytes(device, len(pages)))

    def restore(self, host, host_pages, device, pages) -> Transfer:
        pages, host_pages = list(pages), list(host_pages)
        return self._defer(lambda: _restore_now(host, host_pages, device, pages, False), _nbytes(device, len(pages)))

    def fence(self, transfers: Sequence[Transfer]) -> None:
        pending = [t for t in transfers if not t.done()]
        while pending and self._queue:  # a fence waits for its batches, hence for every batch issued before them
            self.run(1)
            pending = [t for t in pending if not t.done()]


def copier_for(device: torch.device) -> PageCopier:
    return CudaCopier(device) if device.type == "cuda" else SyncCopier()
