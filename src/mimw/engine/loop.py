"""EngineLoop: runs an ``Engine`` on its own thread; other threads submit, abort and read stats.

Threading contract:
  * Only the loop thread touches the ``Engine``. ``submit`` and ``abort`` enqueue commands that the loop applies
    between steps; ``stats`` returns the snapshot taken after the latest step (immutable, safe to share).
  * Events reach a request's ``on_output`` callback on the loop thread; callbacks must be quick and non-blocking
    (the server's callback only hands the event to its asyncio loop).
  * The number of requests that are queued (submitted but not yet admitted to a batch) is bounded by
    ``max_queue``: past it ``submit`` raises ``QueueFull`` instead of growing memory.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Callable, Sequence

from ..profiling import phase
from .engine import Engine, EngineStats, RequestError
from .request import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("mimw.engine")


class QueueFull(RuntimeError):
    """Too many requests are waiting; retry later."""


class EngineDead(RuntimeError):
    """The loop thread is not running (stopped or crashed)."""


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int = 256):
        if max_queue <= 0:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._cv = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._pending = 0  # submitted, not yet admitted by the engine (inbox + engine's waiting queue)
        self._stats = engine.stats()
        self._stop = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="mimw-engine", daemon=True)
        self.error: str | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and not self._closing

    def close(self) -> None:
        """Refuse new requests and abort the running ones (their clients get a final "abort" event): the first
        step of a graceful shutdown, so that open streams end instead of holding the server up."""
        with self._cv:
            self._closing = True
            self._inbox.append(("abort_all",))
            self._cv.notify()

    # --- called from other threads ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], session_id: str | None = None,
               close_session: bool = False) -> None:
        """Queue a request. Validates lengths first (``RequestError``); ``QueueFull`` past ``max_queue``.
        ``session_id`` / ``close_session``: see ``Engine.add_request``."""
        if not self.alive:
            raise EngineDead(self.error or ("the server is shutting down" if self._closing else
                                            "the engine is not running"))
        self.engine.validate(prompt_token_ids, params)  # pure: safe from any thread
        self.engine.check_session_id(session_id)
        with self._cv:
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests are already waiting (limit {self.max_queue})")
            self._pending += 1
            self._inbox.append(("add", request_id, list(prompt_token_ids), params, on_output, time.monotonic(),
                                session_id, close_session))
            self._cv.notify()

    def close_session(self, session_id: str) -> "Future[bool]":
        """Close a session on the loop thread; the future says whether it was live."""
        fut: Future[bool] = Future()
        with self._cv:
            self._inbox.append(("close_session", session_id, fut))
            self._cv.notify()
        return fut

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def stats(self) -> EngineStats:
        return self._stats

    # --- the loop thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._inbox and not self.engine.has_work():
                        self._cv.wait()
                    if self._stop:
                        break
                    commands = list(self._inbox)
                    self._inbox.clear()
                with phase("inbox"):
                    for cmd in commands:
                        self._apply(cmd)
                if self.engine.has_work():
                    before = self._stats.steps
                    events = []
                    try:
                        with phase("step"):
                            events = self.engine.step()
                    except Exception:  # a bug in a step: fail the requests in flight, keep serving new ones
                        log.exception("engine step failed; failing the requests in flight")
                        self.engine.fail_all("internal error in the engine step (see the server log)")
                    if not events and self.engine.stats().steps == before:  # nothing ran (all waiting): don't spin
                        with self._cv:
                            self._cv.wait(0.005)
                self._publish()
        except BaseException:  # a bug in the engine itself: record it so /health and submit report it
            self.error = "engine loop crashed: " + traceback.format_exc(limit=5)
            raise
        finally:
            self.engine.abort_all()
            with self._cv:  # nobody will apply these any more
                for cmd in self._inbox:
                    if cmd[0] == "close_session" and not cmd[2].done():
                        cmd[2].set_result(False)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, on_output, t, sid, close = cmd
            try:
                self.engine.add_request(rid, ids, params, on_output, arrival_time=t, session_id=sid,
                                        close_session=close)
            except RequestError as e:  # raced past submit's checks (e.g. a bad token id): report, don't crash
                with self._cv:
                    self._pending -= 1
                try:
                    on_output(RequestOutput(rid, "", (), True, "error", len(ids), 0, 0, str(e)))
                except Exception:  # the consumer is gone; nothing else to tell
                    pass
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        elif cmd[0] == "close_session":
            cmd[2].set_result(self.engine.close_session(cmd[1]))
        else:
            self.engine.abort_all()

    def _publish(self) -> None:
        s = self.engine.stats()
        with self._cv:
            self._pending = s.waiting + sum(1 for c in self._inbox if c[0] == "add")
        self._stats = s
