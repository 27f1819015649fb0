"""Host-to-device copies through pinned memory (mimw.pinned) on the CPU: ``to_device``'s values, and the ring of
host buffers that ``StepInputs`` packs into (the GPU's non-blocking path: the prefill, step-graph and sampling GPU
tests)."""
import random

import pytest
import torch

from mimw.pinned import PinnedRing, to_device


def test_to_device_gives_the_values_on_the_device():
    t = torch.arange(5, dtype=torch.int32)
    out = to_device(t, "cpu")
    assert out.device.type == "cpu" and out.dtype == torch.int32 and out.tolist() == [0, 1, 2, 3, 4]


class Stream:
    """A stand-in for the GPU's stream: recorded events complete in queue order, when the test lets them run."""

    def __init__(self):
        self.queue: list["FakeEvent"] = []
        self.synced = 0

    def run(self, n: int) -> None:
        for ev in self.queue[:n]:
            ev.done = True
        del self.queue[:n]

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: Stream):
        self.stream, self.done, self.recorded = stream, True, 0

    def record(self) -> None:
        self.done = False
        self.recorded += 1
        self.stream.queue.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the host waits: the stream runs up to this event
        if not self.done:
            self.stream.synced += 1
            self.stream.run(self.stream.queue.index(self) + 1)


@pytest.mark.parametrize("depth", [2, 3])
def test_the_ring_never_hands_out_a_buffer_before_the_copy_that_last_read_it_completed(depth):
    rng = random.Random()
    stream = Stream()
    ring = PinnedRing(4, "cpu", depth=depth, event=stream.event)
    events: dict[int, FakeEvent] = {}
    order = []
    for step in range(300):
        slot, buf = ring.next()
        order.append(slot)
        assert buf is ring.buffers[slot]
        if slot in events:
            assert events[slot].done  # its last copy has run (or the ring waited for it)
        buf.fill_(step)  # the host packs it
        ring.copied(slot)
        events[slot] = ring._events[slot]
        stream.run(rng.choice([0, 0, 1, 2]))  # the GPU runs 0..2 queued copies meanwhile, slower than the host
    assert order == [i % depth for i in range(300)]  # in turn
    assert ring.stalls == stream.synced > 0  # each wait counted, and the random stream did make the host wait


def test_the_ring_does_not_wait_when_the_stream_keeps_up_and_refuses_out_of_turn_copies():
    stream = Stream()
    ring = PinnedRing(4, "cpu", depth=2, event=stream.event)
    for _ in range(10):
        slot, _ = ring.next()
        ring.copied(slot)
        stream.run(1)
    assert ring.stalls == 0 and stream.synced == 0
    slot, _ = ring.next()
    with pytest.raises(RuntimeError, match="not the one handed out last"):
        ring.copied(1 - slot)
    with pytest.raises(ValueError, match="at least 2"):
        PinnedRing(4, "cpu", depth=1)


def test_the_ring_grows_its_buffers_and_uses_no_events_on_the_cpu():
    ring = PinnedRing(0, "cpu")
    assert ring.words == 0 and not ring.pinned
    ring.reserve(10)
    assert [b.numel() for b in ring.buffers] == [10, 10]
    ring.reserve(6)  # never shrinks
    assert ring.words == 10
    slot, _ = ring.next()
    ring.copied(slot)
    assert ring._events == [None, None]


def test_a_copy_into_a_buffer_is_waited_for_before_the_host_reads_it():
    """The device-to-host use (the sampled ids): ``wait`` runs the stream up to the copy marked on that buffer,
    not past it."""
    stream = Stream()
    ring = PinnedRing(4, "cpu", depth=2, event=stream.event)
    a, _ = ring.next()
    ring.copied(a)
    b, _ = ring.next()
    ring.copied(b)
    ring.wait(a)
    assert ring._events[a].done and not ring._events[b].done and stream.synced == 1
    ring.wait(a)  # landed already: no second wait
    assert stream.synced == 1
    cpu = PinnedRing(4, "cpu")
    slot, _ = cpu.next()
    cpu.copied(slot)
    cpu.wait(slot)  # no events on the CPU: nothing to wait for
