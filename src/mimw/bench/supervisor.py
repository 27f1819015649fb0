"""Supervisor: runs the worker in a child process and survives whatever a backend does to it.

A backend under test can hang (a compile that never ends, a kernel deadlock) or poison the CUDA context (an illegal
address in a new kernel). Each model's tasks run in a child process (``mimw.bench.worker``) that appends JSON events
to a file; the supervisor follows the file and:
  - forwards every ``result`` event to ``on_result`` as it arrives (the caller writes reports incrementally);
  - kills the child when no event arrived for ``backend_timeout_s`` while a backend builds (compiles, captures), or
    for ``RUN_TIMEOUT_S`` once it runs steps (check and timing phases: a deadlocked kernel should not cost 5 minutes),
    and records the task in progress as a timeout;
  - when the child dies with tasks left, records the task in progress (if any) as an error with the exit code and
    starts a fresh child for the rest. A child that dies before starting any task ends the model: its remaining
    tasks are recorded with the setup error, since a restart would fail the same way.
Every restart consumes at least one task, so the loop ends. In-process mode (``in_process``) calls the worker
directly: no isolation, for debugging and CPU tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from .config import DecodeBenchConfig
from .worker import run_tasks

RUN_TIMEOUT_S = 90.0  # a check or timing phase takes seconds; this much silence is a hang
OnResult = Callable[[dict], None]
OnSetup = Callable[[dict], None]


def failure_row(model: str, context: int, backend: str, error: str, status: str = "error") -> dict:
    return {"event": "result", "model": model, "context": context, "backend": backend, "status": status,
            "ms_per_step": None, "bytes_per_step": None, "timing": None, "check": None, "notes": "", "error": error}


def _read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    events = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return events, offset + len(complete)


def run_model(model: str, cfg: DecodeBenchConfig, on_result: OnResult, on_setup: OnSetup,
              worker_cmd: Sequence[str] | None = None, poll_s: float = 0.5) -> None:
    """Measure every (context, backend) of ``cfg`` for ``model``; each outcome reaches ``on_result`` exactly once."""
    remaining = [(c, b) for c in cfg.contexts for b in cfg.backends]
    if cfg.in_process:
        def emit(ev: dict) -> None:
            (on_result if ev["event"] == "result" else on_setup if ev["event"] == "setup" else (lambda e: None))(ev)
        run_tasks(model, remaining, cfg, emit)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="mimw-bench-") as tmp:
        attempt = 0
        while remaining:
            attempt += 1
            events_path = Path(tmp) / f"events-{attempt}.jsonl"
            tasks = ",".join(f"{c}:{b}" for c, b in remaining)
            cmd = list(worker_cmd or [sys.executable, "-m", "mimw.bench.worker"])
            proc = subprocess.Popen([*cmd, cfg.to_json(), model, tasks, str(events_path)], env=env)
            offset, current, started_any, last_event = 0, None, False, time.monotonic()
            limit = cfg.backend_timeout_s
            killed_for_timeout = False
            while True:
                rc = proc.poll()
                events, offset = _read_new(events_path, offset)
                for ev in events:
                    last_event = time.monotonic()
                    kind = ev.get("event")
                    if kind == "setup":
                        on_setup(ev)
                    elif kind == "start":
                        current, started_any = (ev["context"], ev["backend"]), True
                        limit = cfg.backend_timeout_s
                    elif kind == "phase":
                        limit = min(cfg.backend_timeout_s, RUN_TIMEOUT_S + cfg.budget_s)
                    elif kind == "result":
                        key = (ev["context"], ev["backend"])
                        if key in remaining:
                            remaining.remove(key)
                            on_result(ev)
                        current, limit = None, cfg.backend_timeout_s
                if rc is not None:
                    break
                if time.monotonic() - last_event > limit:
                    proc.kill()
                    proc.wait()
                    killed_for_timeout = True
                    break
                time.sleep(poll_s)
            if not remaining:
                break
            rc = proc.returncode
            if current is not None and current in remaining:
                why = (f"timeout: no progress for {limit:.0f} s, killed" if killed_for_timeout
                       else f"worker died (exit code {rc})")
                remaining.remove(current)
                on_result(failure_row(model, current[0], current[1], why, "timeout" if killed_for_timeout
                                      else "error"))
            elif not started_any or killed_for_timeout:
                why = ("setup timed out" if killed_for_timeout else f"worker failed during setup (exit code {rc})")
                for c, b in remaining:
                    on_result(failure_row(model, c, b, why))
                remaining = []
            if remaining:
                print(f"[bench] restarting worker for {len(remaining)} remaining task(s)", file=sys.stderr,
                      flush=True)
