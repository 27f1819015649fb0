"""Manual CUDA-graph capture of a step function (the standard warm-up-on-a-side-stream recipe).

Warm-up runs on a side stream first: lazy initialisation (cuBLAS handles, workspace allocation, Triton autotuning)
must not happen during capture. The returned graph replays the captured kernels on the same static tensors, so the
captured function's inputs must be tensors whose storage stays put, and its output is overwritten on every replay.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def inductor_cudagraph_skips() -> int:
    """How many times Inductor has declined to use CUDA graphs in this process (its ``cudagraph_skips`` counter):
    a ``reduce-overhead`` compile that bumps it runs without graphs, and its notes must say so."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"]["cudagraph_skips"])
