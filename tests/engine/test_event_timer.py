"""EventTimer with stand-in events (CPU): spans come back once their end completed, in order, with their times;
read events are recorded again by later spans, so a step timed every step makes no new event once the pool fills."""
from mimw.engine.backends.base import EventTimer


class FakeEvent:
    def __init__(self, clock: list[float]):
        self.clock, self.at, self.done = clock, None, False

    def record(self) -> None:
        self.at, self.done = self.clock[0], False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done
        return end.at - self.at


def test_spans_come_back_when_done_and_their_events_are_reused():
    clock = [0.0]
    made: list[FakeEvent] = []
    timer = EventTimer(lambda: made.append(FakeEvent(clock)) or made[-1])
    a = timer.start()
    clock[0] = 2.0
    timer.stop(a, "a")
    b = timer.start()
    clock[0] = 5.0
    timer.stop(b, "b")
    assert timer.completed() == [] and len(made) == 4  # nothing reached yet
    for e in made[:2]:  # the GPU reached span a only
        e.done = True
    assert timer.completed() == [("a", 2.0)]
    for e in made:
        e.done = True
    assert timer.completed() == [("b", 3.0)]
    for step in range(50):  # a step timed every step: the read events come back, none is made
        s = timer.start()
        clock[0] += 1.5
        timer.stop(s, step)
        for e in made:
            e.done = True
        assert timer.completed() == [(step, 1.5)]
    assert len(made) == 4
