"""Page copies between the device KV pool and the host tier's pool, in batches that complete asynchronously.

The two pools hold the same per-page tensors (``PagedKVCache.page_tensors``: K, V and whatever else a page
carries, such as FP8 scales), laid out differently:

    device pool: t[layer, page, ...]        one tensor per entry of page_tensors()
    host pool:   t[page, layer, ...]        host page i is one contiguous block, so one DMA moves a page

A ``PageCopier`` issues a batch (``offload``: device pages -> host pages, ``restore``: host -> device) after the
batches listed in ``after`` and returns a ``Transfer`` whose ``done()`` says whether it has completed. Each
direction is a queue of its own (offloads never wait behind restores, nor the reverse), run in issue order; the
caller (``mimw.kv.host_tier``) lists in ``after`` the earlier batches of the other direction that touch the same
pages. Three implementations, one contract:

  * ``SyncCopier``: copies at once (a CPU-only engine, where both pools are host memory); ``done()`` is True.
  * ``CudaCopier``: a copy stream per direction. A batch first waits (on the GPU) for the compute work already
    issued, so that it reads what the earlier steps wrote, and for its ``after`` batches; ``done()`` queries its
    CUDA event; ``fence`` makes the compute stream wait for a batch before the next step touches pages it reads
    or writes. The host never blocks.
  * ``DeferredCopier``: runs each batch later, when the caller says (``run``), reading the source then: a CPU
    model of asynchronous copies that tests use to check that nothing reads a page before its copy is done or
    overwrites it while a copy still has to read it.
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
                host_pages: Sequence[int], after: Sequence[Transfer] = ()) -> Transfer:
        """Copy device ``pages`` into ``host_pages`` (same order) of every tensor pair, after ``after``."""

    @abstractmethod
    def restore(self, host: Sequence[torch.Tensor], host_pages: Sequence[int], device: Sequence[torch.Tensor],
                pages: Sequence[int], after: Sequence[Transfer] = ()) -> Transfer:
        """Copy ``host_pages`` into device ``pages`` (same order) of every tensor pair, after ``after``."""

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
    def offload(self, device, pages, host, host_pages, after=()) -> Transfer:
        _offload_now(device, pages, host, host_pages, non_blocking=False)
        return Transfer(_nbytes(device, len(pages)))

    def restore(self, host, host_pages, device, pages, after=()) -> Transfer:
        _restore_now(host, host_pages, device, pages, non_blocking=False)
        return Transfer(_nbytes(device, len(pages)))


class CudaCopier(PageCopier):
    """Copies on two streams of ``device`` (one per direction); the host pool must be pinned for the copies to
    be asynchronous."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {"offload": torch.cuda.Stream(device), "restore": torch.cuda.Stream(device)}

    def _issue(self, direction: str, run: Callable[[], list[torch.Tensor]], nbytes: int,
               after: Sequence[Transfer]) -> Transfer:
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # read what the steps issued so far wrote
        for t in after:
            if not t.done() and t._event is not None:
                stream.wait_event(t._event)
        with torch.cuda.stream(stream):
            keep = run()
            event = torch.cuda.Event()
            event.record(stream)
        return Transfer(nbytes, event, tuple(keep))

    def offload(self, device, pages, host, host_pages, after=()) -> Transfer:
        return self._issue("offload", lambda: _offload_now(device, pages, host, host_pages, non_blocking=True),
                           _nbytes(device, len(pages)), after)

    def restore(self, host, host_pages, device, pages, after=()) -> Transfer:
        return self._issue("restore", lambda: _restore_now(host, host_pages, device, pages, non_blocking=True),
                           _nbytes(device, len(pages)), after)

    def fence(self, transfers: Sequence[Transfer]) -> None:
        compute = torch.cuda.current_stream(self.device)
        for t in transfers:
            if not t.done() and t._event is not None:
                compute.wait_event(t._event)


class _Deferred(Transfer):
    def __init__(self, nbytes: int, direction: str, seq: int, after: list[Transfer]):
        super().__init__(nbytes, None)
        self._done = False
        self.direction, self.seq, self.after = direction, seq, after


class DeferredCopier(PageCopier):
    """Runs each batch only when ``run`` (or a ``fence`` on it) says so, in issue order within its direction and
    after its ``after`` batches; a batch reads its source when it runs, as a DMA engine would. With ``rng``,
    ``run`` picks the direction to advance at random (the two streams progress independently)."""

    def __init__(self, rng=None):
        self.rng = rng
        self._queues: dict[str, deque[tuple[_Deferred, Callable[[], object]]]] = {"offload": deque(),
                                                                                  "restore": deque()}
        self._seq = 0

    @property
    def num_pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def run(self, n: int | None = None) -> None:
        """Complete ``n`` pending batches (all when None): the oldest, or with ``rng`` a random direction's next."""
        for _ in range(self.num_pending if n is None else n):
            ready = [q for q in self._queues.values() if q]
            if not ready:
                return
            q = self.rng.choice(ready) if self.rng is not None else min(ready, key=lambda q: q[0][0].seq)
            self._run_through(q[0][0])

    def _run_through(self, t: _Deferred) -> None:
        q = self._queues[t.direction]
        while not t.done():
            head, work = q[0]
            for dep in head.after:
                self._run_through(dep)  # type: ignore[arg-type]
            q.popleft()
            work()
            head._done = True

    def _defer(self, direction: str, work: Callable[[], object], nbytes: int, after: Sequence[Transfer]) -> Transfer:
        self._seq += 1
        t = _Deferred(nbytes, direction, self._seq, [a for a in after if not a.done()])
        self._queues[direction].append((t, work))
        return t

    def offload(self, device, pages, host, host_pages, after=()) -> Transfer:
        pages, host_pages = list(pages), list(host_pages)
        return self._defer("offload", lambda: _offload_now(device, pages, host, host_pages, False),
                           _nbytes(device, len(pages)), after)

    def restore(self, host, host_pages, device, pages, after=()) -> Transfer:
        pages, host_pages = list(pages), list(host_pages)
        return self._defer("restore", lambda: _restore_now(host, host_pages, device, pages, False),
                           _nbytes(device, len(pages)), after)

    def fence(self, transfers: Sequence[Transfer]) -> None:
        for t in transfers:
            if not t.done():
                self._run_through(t)  # type: ignore[arg-type]


def copier_for(device: torch.device) -> PageCopier:
    return CudaCopier(device) if device.type == "cuda" else SyncCopier()
