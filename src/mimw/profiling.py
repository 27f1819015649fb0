"""Named host phases for ``torch.profiler``: ``phase("schedule")`` marks a span ``mimw.schedule`` in a profiled
run's trace (a ``record_function`` range) and costs one flag check otherwise (~0.1 us against ~6 us for a
``record_function`` entered unconditionally), so the engine's step carries its phases always. The flag is the
profiler module's process-wide one, not the thread's: the engine steps on its loop thread while the profiler runs on
another (recording every thread: ``profile_all_threads``). The overlap bench's gap summary
(``mimw.bench.profile_gaps``) charges the device's idle time to the phases."""
from __future__ import annotations

from contextlib import nullcontext

import torch.autograd.profiler as _profiler
from torch.profiler import record_function

PREFIX = "mimw."
_NULL = nullcontext()


def phase(name: str):
    """A context manager: a ``mimw.<name>`` range while a profiler records, else nothing."""
    return record_function(PREFIX + name) if getattr(_profiler, "_is_profiler_enabled", False) else _NULL


__all__ = ["PREFIX", "phase"]
