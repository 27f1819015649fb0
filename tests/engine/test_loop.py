"""EngineLoop: the engine on its own thread, fed from other threads, with a bounded queue."""
import threading

import pytest

from mimw.engine.engine import RequestError
from mimw.engine.loop import EngineDead, EngineLoop, QueueFull
from mimw.engine.sampling import SamplingParams

P = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Collector:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.finished:
            self.done.set()


def test_submit_from_threads_and_finish(make_engine):
    loop = EngineLoop(make_engine(num_pages=64, page_size=4)).start()
    try:
        cs = [Collector() for _ in range(8)]
        ts = [threading.Thread(target=loop.submit, args=(f"r{i}", [5 + i, 6, 7], P, c)) for i, c in enumerate(cs)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert all(c.done.wait(30) for c in cs)
        assert all(c.events[-1].completion_tokens == 6 for c in cs)
        with pytest.raises(RequestError):
            loop.submit("bad", [], P, Collector())
    finally:
        loop.stop()
    assert loop.stats().pages_in_use == 0
    with pytest.raises(EngineDead):
        loop.submit("late", [1, 2], P, Collector())


def test_queue_is_bounded(make_engine):
    eng = make_engine(num_pages=64, page_size=4)
    gate, real_step = threading.Event(), eng.step
    eng.step = lambda: (gate.wait(30), real_step())[1]  # hold the loop inside its first step
    loop = EngineLoop(eng, max_queue=2).start()
    try:
        a, b = Collector(), Collector()
        loop.submit("a", [1, 2, 3], P, a)
        loop.submit("b", [1, 2, 3], P, b)
        with pytest.raises(QueueFull):
            loop.submit("c", [1, 2, 3], P, Collector())
        gate.set()
        assert a.done.wait(30) and b.done.wait(30)
        loop.submit("d", [1, 2, 3], P, Collector())  # room again
    finally:
        gate.set()
        loop.stop()


def test_abort_mid_generation_returns_pages(make_engine):
    loop = EngineLoop(make_engine(num_pages=64, page_size=4)).start()
    try:
        c = Collector()
        first = threading.Event()
        loop.submit("long", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                    lambda ev: (c(ev), first.set()))
        assert first.wait(30)
        loop.abort("long")
        assert c.done.wait(30) and c.events[-1].finish_reason == "abort"
    finally:
        loop.stop()
    assert loop.stats().pages_in_use == 0


def test_close_aborts_running_requests_and_refuses_new_ones(make_engine):
    loop = EngineLoop(make_engine(num_pages=64, page_size=4)).start()
    try:
        c, first = Collector(), threading.Event()
        loop.submit("long", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                    lambda ev: (c(ev), first.set()))
        assert first.wait(30)
        loop.close()
        assert c.done.wait(30) and c.events[-1].finish_reason == "abort"
        assert not loop.alive
        with pytest.raises(EngineDead, match="shutting down"):
            loop.submit("late", [1, 2], P, Collector())
    finally:
        loop.stop()


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(make_engine):
    eng = make_engine(num_pages=64, page_size=4)
    real, calls = eng.scheduler.commit, []

    def broken_once(plan):
        if not calls:
            calls.append(1)
            raise RuntimeError("scheduler bug")
        return real(plan)

    eng.scheduler.commit = broken_once
    loop = EngineLoop(eng).start()
    try:
        a = Collector()
        loop.submit("a", [5, 6, 7], P, a)
        assert a.done.wait(30) and a.events[-1].finish_reason == "error"
        b = Collector()
        loop.submit("b", [5, 6, 7], P, b)
        assert b.done.wait(30) and b.events[-1].finish_reason == "length" and loop.alive
    finally:
        loop.stop()
    assert loop.stats().pages_in_use == 0
