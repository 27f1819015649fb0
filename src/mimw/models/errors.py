"""Errors raised while reading a checkpoint (Hugging Face directory or GGUF file)."""
from __future__ import annotations

from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint mimw cannot load. The message names the file and the tensor or field at fault, and says
    what was expected, so that the CLI can print it as is (no traceback)."""


def check_finite(t: torch.Tensor, name: str, file: str | Path) -> None:
    """Refuse a weight holding NaN or infinity: a corrupt file (or a broken conversion) that would otherwise
    produce garbage text without an error."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())):  # one reduction: NaN and inf propagate
        return
    bad = int((~torch.isfinite(t)).sum())  # the sum may also have overflowed on finite values
    if bad:
        raise CheckpointError(f"{file}: tensor {name!r} holds {bad} NaN/infinite value(s) (corrupt checkpoint?)")
