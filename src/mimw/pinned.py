"""Host-to-GPU copies that never wait for the GPU: the host values go through pinned memory by non-blocking copies,
queued in stream order. A copy from pageable memory first waits for every kernel queued before it, so the host could
not prepare the next step while this one runs.

``to_device``: a one-off host tensor through a temporary pinned copy (the caching host allocator reuses a pinned
block only once the copies that read it have completed). ``PinnedRing``: the host side of a copy made every step
(``step_inputs.StepInputs``): a few pinned buffers used in turn, each reused only once the copy that last read it
has completed (an event per buffer), so the host packs step k + 1 while step k's copy may still be reading. The
same ring takes copies the other way (the sampled ids, ``engine/overlap.py``): ``wait`` holds the host until the
copy into a buffer has landed."""
from __future__ import annotations

from typing import Callable, Protocol

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: through pinned memory, not waiting, where a host tensor goes to a CUDA device."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Event(Protocol):
    """What the ring needs of a CUDA event (``torch.cuda.Event``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedRing:
    """``depth`` host buffers of int64 words, handed out in turn (``next``). On a CUDA device they are pinned and
    each carries an event, recorded on the current stream after the copy that reads it (``copied``); ``next``
    waits for that event before it hands the buffer out again, so no buffer is rewritten while a copy may still
    read it. With ``depth`` 2 and one copy a step, the wait is for the copy of two steps ago, which the stream has
    long run whenever the host is at most one step ahead (the overlap scheduler's lead): no wait in practice.
    ``stalls`` counts the hand-outs that found their buffer's copy not yet complete (the host waited there).

    On the CPU (``device`` cpu) the buffers are plain memory and there are no events: a CPU copy is complete when
    it returns. ``event``, where given, makes the events (the CPU tests' stand-ins)."""

    def __init__(self, words: int, device: torch.device | str, depth: int = 2,
                 event: Callable[[], Event] | None = None):
        if depth < 2:
            raise ValueError(f"a ring needs at least 2 buffers (one packing while another is copied), got {depth}")
        cuda = torch.device(device).type == "cuda"
        self.pinned = cuda
        self._make_event = event if event is not None else (torch.cuda.Event if cuda else None)
        self.depth = depth
        self.stalls = 0
        self._slot = depth - 1  # the buffer handed out last (none yet: the first ``next`` is slot 0)
        self._events: list[Event | None] = [None] * depth  # None: never copied from
        self._alloc(words)

    def _alloc(self, words: int) -> None:
        self.buffers = [torch.zeros(words, dtype=torch.int64, pin_memory=self.pinned) for _ in range(self.depth)]

    @property
    def words(self) -> int:
        return self.buffers[0].numel()

    def reserve(self, words: int) -> None:
        """Room for ``words`` in every buffer: new buffers of ``words`` where they are smaller. The old ones may
        still be read by queued copies; the caching host allocator keeps them until those complete."""
        if words > self.words:
            self._alloc(words)

    def next(self) -> tuple[int, torch.Tensor]:
        """The next buffer in turn (slot, tensor), once the copy that last read it has completed."""
        self._slot = (self._slot + 1) % self.depth
        ev = self._events[self._slot]
        if ev is not None:
            if not ev.query():
                self.stalls += 1
                ev.synchronize()
        return self._slot, self.buffers[self._slot]

    def wait(self, slot: int) -> None:
        """Wait for the copy last marked on buffer ``slot`` (``copied``): a copy into it has landed, the host may
        read it. No wait on the CPU (no events)."""
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()

    def copied(self, slot: int) -> None:
        """The copy reading buffer ``slot`` is queued (on the current stream): mark where it ends."""
        if slot != self._slot:
            raise RuntimeError(f"buffer {slot} is not the one handed out last ({self._slot})")
        if self._make_event is not None:
            ev = self._events[slot]
            if ev is None:
                ev = self._events[slot] = self._make_event()
            ev.record()
