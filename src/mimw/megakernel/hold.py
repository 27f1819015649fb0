"""The release hold's marks: which releases compute announces and where the loader waits for them.

The release hold (``Tuning.quiet``, docs/megakernel.md): at a streaming instruction that starts a new stage on its
SM (it waits for another counter than the SM's previous signalling streaming instruction), the loader requests at
most ``quiet`` of its tiles before that previous instruction has released its counter, so the release's fence does
not wait behind a full ring of tile requests. Compute announces a release by arriving on a one-count mbarrier; the
loader waits for that phase.

The host reads the rule off the program once and marks the words (``isa.HOLD_ARRIVE`` on the releases some hold
waits for, ``isa.HOLD_WAIT`` on the holding instructions): compute arrives only where marked, the loader counts the
marked releases it walks past and waits only where marked, so every mbarrier phase is waited for (compute-sanitizer's
synccheck has no "Missing wait" to report) and both roles read the same decision. A hold that the instruction's
tiles never reach (``quiet`` or fewer tiles) waits for nothing, so its release is not announced either. Pure host
logic, tested on the CPU (tests/megakernel/test_hold.py).
"""
from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from . import isa

if TYPE_CHECKING:
    from .program import Program


def hold_marks(program: "Program", quiet: int) -> list[list[int]]:
    """Per SM queue, per instruction: its ``isa.HOLD_ARRIVE | isa.HOLD_WAIT`` bits (all 0 where ``quiet`` < 0)."""
    marks = [[0] * len(q) for q in program.queues]
    if quiet < 0:
        return marks
    for q, m in zip(program.queues, marks):
        last = None  # the SM's last signalling streaming instruction so far: the release a hold waits for
        last_wait = None
        for k, ins in enumerate(q):
            streams = ins.tiles.n_tiles > 0
            if streams and last is not None and ins.wait != last_wait and ins.tiles.n_tiles > quiet:
                m[last] |= isa.HOLD_ARRIVE
                m[k] |= isa.HOLD_WAIT
            if streams and ins.signal != isa.NO_COUNTER:
                last, last_wait = k, ins.wait
    return marks


def mark_words(words: torch.Tensor, marks: list[list[int]]) -> torch.Tensor:
    """``words`` ([num_sms, max_len, NWORDS] int32, Program.encode) with the marks or'ed into each word's FLAGS."""
    out = words.clone()
    for s, m in enumerate(marks):
        if m:
            out[s, :len(m), isa.Word.FLAGS] |= torch.tensor(m, dtype=out.dtype)
    return out


def check_marks(marks: list[list[int]]) -> None:
    """Every announced release is waited for before the next one (one mbarrier phase each, none left unwaited or
    aliased); raises ValueError naming the first SM and instruction that breaks it."""
    for s, m in enumerate(marks):
        pending = None  # index of an announced release not yet waited for
        announced = False  # any release announced so far (a later hold may wait again for the last one)
        for k, bits in enumerate(m):
            if bits & isa.HOLD_WAIT:
                if not announced:
                    raise ValueError(f"SM {s} instruction {k} holds for a release nobody announced")
                pending = None
            if bits & isa.HOLD_ARRIVE:
                if pending is not None:
                    raise ValueError(f"SM {s}: the release of instruction {pending} is announced and never waited for")
                pending, announced = k, True
        if pending is not None:
            raise ValueError(f"SM {s}: the release of instruction {pending} is announced and never waited for")
