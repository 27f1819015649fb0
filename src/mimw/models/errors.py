"""Errors raised while reading a checkpoint (Hugging Face directory or GGUF file)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint mimw cannot load. The message names the file and the tensor or field at fault, and says
    what was expected, so that the CLI can print it as is (no traceback)."""
