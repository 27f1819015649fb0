"""The floor: the fastest a batch-1 decode step can possibly be on this GPU.

A step must read every weight once (``spec.decode_weight_bytes()``: all layers, the final norm, the LM head and one
embedding row) and the KV cache it attends to (``context * spec.kv_bytes_per_token()``), so no implementation beats
``bytes / B`` where B is the streaming-read bandwidth measured in the same run (``mimw.bench.bandwidth``).
Everything here is arithmetic; times in milliseconds, bandwidths in bytes/s unless the name says TB/s (1e12 B/s).
"""
from __future__ import annotations

from ..models.spec import ModelSpec


def step_bytes(spec: ModelSpec, context: int, bytes_per_param: int = 2, kv_bytes_per_elem: int = 2) -> int:
    """Bytes one decode step at ``context`` must read."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return spec.decode_weight_bytes(bytes_per_param) + context * spec.kv_bytes_per_token(kv_bytes_per_elem)


def floor_ms(nbytes: int, read_bytes_per_s: float) -> float:
    if read_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {read_bytes_per_s}")
    return nbytes / read_bytes_per_s * 1e3


def achieved_tbps(nbytes: int, ms: float) -> float:
    """Effective TB/s of a step that takes ``ms`` for ``nbytes`` of compulsory traffic."""
    return nbytes / (ms * 1e-3) / 1e12


def tokens_per_s(ms: float) -> float:
    return 1e3 / ms
