"""The Python heap a started engine keeps: what start-up built (the weights' tensors, compiled kernels and their
launchers, CUDA graphs, the tokenizer's tables) lives as long as the process, so the cyclic garbage collector need
not walk it again. ``freeze_heap`` collects once and moves every surviving object to the permanent generation
(``gc.freeze``, as vLLM and SGLang do after start-up): a full collection that serving later triggers walks only
what serving allocated since, not the start-up heap. ``frozen_heap`` does the same for a span (a benchmark's
measure) and gives the objects back to the collector after it: what became garbage meanwhile is collected then."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


def freeze_heap() -> int:
    """Collect, then freeze every object left; returns how many are frozen (``gc.get_freeze_count``)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """``freeze_heap`` for the span of the ``with`` block (yields the frozen count), ``gc.unfreeze`` after it."""
    try:
        yield freeze_heap()
    finally:
        gc.unfreeze()
