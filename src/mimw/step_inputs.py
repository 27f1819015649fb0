"""StepInputs: the inputs a graphed step reads (token ids, positions, contexts, block tables, slots...) as views
into ONE device buffer, written by ONE non-blocking copy a step from a pinned host buffer that the host packs with
numpy.

A CUDA graph reads its inputs at the addresses it was captured with, so the host writes each step's values into
those same tensors before the replay. Written one tensor at a time that is a copy each (each its own pinned staging
block from the caching host allocator, its own driver call, its own event): a dozen copies a step at batch 32, each
a few microseconds of host time and a queue entry ahead of the replay. Here every input is a view into one int64
buffer (an int32 input is an int64 range viewed as int32), so one copy moves them all.

Layout: the fields in the order given, each starting on a 128-byte boundary (a Triton kernel specialises a pointer
argument on 16-byte alignment, and separately allocated tensors had far more). The host buffers (``PinnedRing``:
two pinned buffers in turn, each reused only once the copy that last read it completed) hold the same layout up to
the last host field; a field with ``host=False`` exists on the device only, after them (written there by the
caller from a host field, e.g. a block table whose row stride is wider than the rows the step uses). A step copies
the host layout's first ``words`` (default: all of it), so a variable-length field placed last costs only what the
step uses.

    inputs = StepInputs([Field("tokens", torch.int64, (T,)), Field("seq_ctx", torch.int32, (B,))], "cuda")
    staged = inputs.stage()                 # the next host buffer (its previous copy completed)
    staged.array("seq_ctx")[:] = ctx        # numpy views of the host buffer, by field
    inputs.load(staged)                     # one non-blocking copy; inputs["seq_ctx"] holds ctx in stream order
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Sequence

import numpy as np
import torch

from .pinned import Event, PinnedRing

ALIGN_WORDS = 16  # 128 bytes: every field's start
_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype  # torch.int32 or torch.int64
    shape: tuple[int, ...]
    host: bool = True  # False: on the device only, never copied (after every host field)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def words(self) -> int:
        """int64 words the field occupies (an int32 field: half its elements, rounded up)."""
        return self.numel if self.dtype == torch.int64 else -(-self.numel // 2)


@dataclass
class Staged:
    """One step's host buffer, handed out by ``StepInputs.stage``: numpy views of its fields, to fill before
    ``StepInputs.load``."""

    slot: int
    words: int  # what ``load`` copies
    buffer: np.ndarray  # [ring words] int64, the pinned buffer's memory
    offsets: dict[str, int]
    fields: dict[str, Field]

    def array(self, name: str, count: int | None = None) -> np.ndarray:
        """The field as a numpy array of its shape, or its first ``count`` elements flat."""
        f, w0 = self.fields[name], self.offsets[name]
        flat = self.buffer[w0:w0 + f.words].view(_NUMPY[f.dtype])[:f.numel]
        return flat[:count] if count is not None else flat.reshape(f.shape)


class StepInputs:
    def __init__(self, fields: Sequence[Field], device: torch.device | str, depth: int = 2,
                 event: Callable[[], Event] | None = None):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"field names repeat: {names}")
        if any(f.dtype not in _NUMPY for f in fields):
            raise ValueError("step inputs are int32 or int64")
        first_device = next((i for i, f in enumerate(fields) if not f.host), len(fields))
        if any(f.host for f in fields[first_device:]):
            raise ValueError("device-only fields come after every host field")
        self.fields = {f.name: f for f in fields}
        self.offsets: dict[str, int] = {}
        end = 0
        self.host_words = 0
        for f in fields:
            self.offsets[f.name] = end
            end += -(-f.words // ALIGN_WORDS) * ALIGN_WORDS
            if f.host:
                self.host_words = self.offsets[f.name] + f.words
        self.device = torch.device(device)
        self.buffer = torch.zeros(max(end, 1), dtype=torch.int64, device=self.device)  # [words] the one buffer
        self._views = {f.name: self._view(f) for f in fields}
        # the host buffers grow to what the steps copy (``stage``): a wide variable field last is paid as used
        self.ring = PinnedRing(0, self.device, depth, event)

    def _view(self, f: Field) -> torch.Tensor:
        w0 = self.offsets[f.name]
        return self.buffer[w0:w0 + f.words].view(f.dtype)[:f.numel].view(f.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The device view of field ``name`` (its shape and dtype; an address that never changes)."""
        return self._views[name]

    def end(self, name: str, count: int) -> int:
        """The words up to and including field ``name``'s first ``count`` elements: what a step that uses only
        those of the field (the last it copies) copies."""
        f = self.fields[name]
        if not f.host or not 0 <= count <= f.numel:
            raise ValueError(f"field {name}: {count} of {f.numel} host elements")
        return self.offsets[name] + (count if f.dtype == torch.int64 else -(-count // 2))

    def spread(self, rows: str, table: str, n: int, width: int) -> None:
        """The first ``n * width`` elements of field ``rows`` (n table rows packed at the step's ``width``) into the
        first n rows and ``width`` columns of the device-only field ``table`` (its rows wider: a fixed stride the
        kernels read), on the device, queued after ``load``; the columns past ``width`` keep what they held."""
        self[table][:n, :width].copy_(self[rows][:n * width].view(n, width))

    def stage(self, words: int | None = None) -> Staged:
        """The next host buffer to pack a step into, once the copy that last read it has completed; ``load``
        will copy its first ``words`` (default: every host field)."""
        words = self.host_words if words is None else words
        if not 0 < words <= self.host_words:
            raise ValueError(f"{words} words of a host layout of {self.host_words}")
        if words > self.ring.words:  # grown geometrically: a table that widens a page a step reallocates rarely
            self.ring.reserve(min(self.host_words, max(words, 2 * self.ring.words)))
        slot, buf = self.ring.next()
        host = {n: f for n, f in self.fields.items() if f.host}
        return Staged(slot, words, buf.numpy(), self.offsets, host)

    def load(self, staged: Staged) -> None:
        """One copy of the staged buffer's words into the device buffer, queued on the current stream (on a GPU
        not waiting for it: the buffer is pinned); the ring reuses the host buffer once that copy has run."""
        src = self.ring.buffers[staged.slot]
        if src.data_ptr() != staged.buffer.ctypes.data:
            raise RuntimeError("the staged buffer is no longer the ring's (staged twice before a load?)")
        n = staged.words
        self.buffer[:n].copy_(src[:n], non_blocking=self.ring.pinned)
        self.ring.copied(staged.slot)
