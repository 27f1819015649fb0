"""The floor: the fastest a batch-1 decode step can possibly be on this GPU.

A step must read every weight once (``spec.decode_weight_bytes()``: all layers, the final norm, the LM head and one
embedding row) and the KV cache it attends to (``context * spec.kv_bytes_per_token()``), so no implementation beats
``bytes / B`` where B is the streaming-read bandwidth measured in the same run (``mimw.bench.bandwidth``).

A mixture-of-experts step reads only the experts its tokens are routed to: the floor counts the attention, router,
norm and dense-MLP weights, the LM head and the KV as above, plus the weights of each MoE layer's distinct routed
experts, once however many tokens chose one (``routed_experts``: what the reference decoder routed in that very
step). A Qwen3-30B-A3B step at batch 1 reads 8 of 128 experts a layer: about 6.1 GB of its 61 GB.
Everything here is arithmetic; times in milliseconds, bandwidths in bytes/s unless the name says TB/s (1e12 B/s).
"""
from __future__ import annotations

from typing import Sequence

from ..models.moe import Routing
from ..models.spec import ModelSpec


def step_bytes(spec: ModelSpec, context: int, bytes_per_param: int = 2, kv_bytes_per_elem: int = 2,
               routed_experts: int | None = None, kv_bytes_per_token: int | None = None) -> int:
    """Bytes one decode step at ``context`` must read; an MoE model's needs the step's ``routed_experts``;
    ``kv_bytes_per_token`` (e.g. ``KVLayout.bytes_per_token()`` of an fp8 cache, scales included) replaces
    ``kv_bytes_per_elem``."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    if spec.is_moe and routed_experts is None:
        raise ValueError(f"{spec.name}: an MoE step's floor needs the experts routed in that step (routed_experts)")
    weights = spec.decode_weight_bytes(bytes_per_param, routed_experts if spec.is_moe else None)
    kv = spec.kv_bytes_per_token(kv_bytes_per_elem) if kv_bytes_per_token is None else kv_bytes_per_token
    return weights + context * kv


def routed_experts(routings: Sequence[Routing]) -> int:
    """The experts a step must read: each MoE layer's distinct routed experts (``ReferenceDecoder.forward``'s
    ``routings``, one per MoE layer), summed over the layers."""
    return sum(len(r.experts) for r in routings)


def floor_ms(nbytes: int, read_bytes_per_s: float) -> float:
    if read_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {read_bytes_per_s}")
    return nbytes / read_bytes_per_s * 1e3


def achieved_tbps(nbytes: int, ms: float) -> float:
    """Effective TB/s of a step that takes ``ms`` for ``nbytes`` of compulsory traffic."""
    return nbytes / (ms * 1e-3) / 1e12


def tokens_per_s(ms: float) -> float:
    return 1e3 / ms
