"""The peer interface: what the benchmark needs from every backend it times.

A factory ``(PeerContext) -> Peer`` builds a backend for one (model, context); building may compile and capture.
It raises ``Unavailable`` when the backend cannot run here (missing module, no CUDA, not implemented yet); any
other exception is reported as an error for that backend alone.

Invariants: ``Peer.step()`` enqueues exactly one decode step of ``ctx.inputs.token`` at position
``ctx.inputs.context`` on the current CUDA stream (no host sync required); after it, ``Peer.logits()`` returns that
step's logits ([V] or [1, V], any float dtype) or None when the backend cannot expose them (reported "unchecked").
An MoE backend may report its routing: after a step, ``Peer.routing()`` returns the experts each MoE layer of that
step ran ([1, k] or [k] ids a layer, in ``spec.moe_layers`` order), or None when it cannot (the default); the worker
reads it after the checked step only, never inside the timed loop, and judges the logits against the reference
forced onto that routing (``mimw.bench.own_route``), or, without it, against every near-tie routing
(``mimw.bench.routes``).

``Peer.reset()`` restores the cache state the step expects (for backends whose cache advances by itself); the
worker calls it before the check and before timing, never inside the timed loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..fused import BenchWeights
from ..inputs import DecodeInputs


class Unavailable(Exception):
    """The backend cannot run in this environment; the message says why."""


@dataclass
class PeerContext:
    bw: BenchWeights
    inputs: DecodeInputs
    device: torch.device
    max_steps: int              # upper bound on steps between two ``reset()`` calls is max_steps + 16
    megakernel: str = ""        # tuning overrides for mimw-megakernel (DecodeBenchConfig.megakernel)


@dataclass
class Peer:
    step: Callable[[], None]
    logits: Callable[[], torch.Tensor | None]
    notes: str = ""
    reset: Callable[[], None] = field(default=lambda: None)
    routing: Callable[[], list[torch.Tensor] | None] = field(default=lambda: None)
    # what a captured graph reads and writes in place (the module with its static caches, the token and position):
    # held as long as the peer, since a graph keeps only its own pool alive and freed inputs would be reused by later
    # allocations under its replays
    keep: tuple = ()


def cache_len_for(context: int, multiple: int = 16) -> int:
    """Static cache rows for a step at position ``context``: context + 1 rounded up to ``multiple``."""
    return -(-(context + 1) // multiple) * multiple


def require_cuda(ctx: PeerContext, what: str) -> None:
    if ctx.device.type != "cuda":
        raise Unavailable(f"{what} needs a CUDA device")
