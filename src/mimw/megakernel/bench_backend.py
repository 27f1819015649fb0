"""`mimw bench` entry for the megakernel backend (contract: ``mimw.bench.peers.mimw_peers``).

``make_step(spec, weights, context, options="", inputs=None)`` builds a MegakernelDecoder (plan.Tuning overrides
``options``, "NAME=VALUE,...", ``Tuning.parse``) over a paged cache holding the benchmark's seeded K/V for positions
0..context-1: ``inputs`` (``mimw.bench.inputs.DecodeInputs``, the run's own: bf16, or fp8 with ``--kv-dtype fp8``, the
cache then e4m3 rows with their scales; reusing them spares a second copy of a long context's K/V on the GPU) or,
without them, ``decode_inputs(spec, context)``. It captures one decode step (token ``inputs.token`` at position ``context``) in a CUDA graph, and returns a
zero-argument callable that replays it; ``step.logits`` is the [1, V] logits buffer.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..models.spec import ModelSpec
from ..models.weights import ModelWeights


def make_step(spec: ModelSpec, weights: ModelWeights, context: int, options: str = "",
              inputs=None) -> Callable[[], None]:
    from .plan import Tuning

    tuning = Tuning.parse(options)  # ValueError on a bad option, before any GPU work
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise NotImplementedError("the megakernel needs a Hopper (sm_90) GPU")
    from ..bench.inputs import decode_inputs, paged_cache
    from .launch.decoder import MegakernelDecoder

    if inputs is None:
        inputs = decode_inputs(spec, context, device="cuda")
    elif inputs.context != context:
        raise ValueError(f"decode inputs for context {inputs.context}, not {context}")
    cache, table = paged_cache(spec, inputs)
    dec = MegakernelDecoder(weights if weights.dtype == torch.bfloat16 else weights.to(dtype=torch.bfloat16),
                            cache, max_pages_per_seq=len(table), tuning=tuning, context_hint=max(1, context))
    dec.set_inputs(inputs.token, context, table)
    dec.capture()

    def step() -> None:
        dec.run()

    step.logits = dec.scratch.logits  # type: ignore[attr-defined]
    step.decoder = dec  # type: ignore[attr-defined]
    return step
