"""Backends the decode benchmark can time, by name, in the order a run measures them.

mimw's own backends carry the ``mimw`` prefix; everything else is a peer (speedups are taken over the best peer).
The megakernel runs first so that its number survives a run cut short.
"""
from __future__ import annotations

from typing import Callable

from .base import Peer, PeerContext, Unavailable
from .hf import hf_transformers
from .mimw_peers import mimw_megakernel, mimw_reference
from .torch_peers import torch_compile_max_autotune, torch_compile_reduce_overhead, torch_eager, torch_eager_graph

BACKENDS: dict[str, Callable[[PeerContext], Peer]] = {
    "mimw-megakernel": mimw_megakernel,
    "mimw-reference": mimw_reference,
    "torch-eager": torch_eager,
    "torch-eager-graph": torch_eager_graph,
    "torch-compile-reduce-overhead": torch_compile_reduce_overhead,
    "torch-compile-max-autotune": torch_compile_max_autotune,
    "hf-transformers": hf_transformers,
}


def is_mimw(backend: str) -> bool:
    return backend.startswith("mimw")


def parse_backends(text: str | None) -> list[str]:
    """Comma list of backend names ("all" or empty: every backend) -> names in run order; unknown names raise."""
    if not text or text.strip() == "all":
        return list(BACKENDS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    return [n for n in BACKENDS if n in names]


__all__ = ["BACKENDS", "Peer", "PeerContext", "Unavailable", "is_mimw", "parse_backends"]
