"""`mimw bench` entry for the megakernel backend (contract: ``mimw.bench.peers.mimw_peers``).

``make_step(spec, weights, context, options="", inputs=None)`` builds a MegakernelDecoder (plan.Tuning overrides
``options``, "NAME=VALUE,...", ``Tuning.parse``) over a paged cache holding the benchmark's seeded K/V for positions
0..context-1: ``inputs`` (``mimw.bench.inputs.DecodeInputs``, the run's own: bf16, or fp8 with ``--kv-dtype fp8``, the
cache then e4m3 rows with their scales; reusing them spares a second copy of a long context's K/V on the GPU) or,
without them, ``decode_inputs(spec, context)``. It captures one decode step (token ``inputs.token`` at position ``context``) in a CUDA graph, and returns a
zero-argument callable that replays it; ``step.logits`` is the [1, V] logits buffer. For an MoE model
``step.routing()`` reads the step's routing back (``routing_entries``): the experts each MoE layer's routing-table row
names, which the bench judges for faithfulness and forces the reference onto (``mimw.bench.own_route``). It reads the
table after a replay, outside the timed loop (a device sync for the epoch and the table).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..models.spec import ModelSpec
from ..models.weights import ModelWeights


def routing_entries(routed: torch.Tensor, epoch: int, moe_layers: Sequence[int]) -> list[torch.Tensor]:
    """The routing table ``routed`` [L, S] (int32 entries, ``isa.route_entry``) as step ``epoch`` wrote it -> the
    experts each MoE layer's row names, [1, n] int64 ascending (unused slots dropped, duplicates kept so that the
    check sees them), in ``moe_layers`` order. An entry without that step's tag was not written by it: ValueError
    naming the layer and slot."""
    from . import isa

    table = routed.cpu().tolist()
    out = []
    for layer in moe_layers:
        experts = []
        for slot, entry in enumerate(table[layer]):
            e = isa.routed_expert(int(entry), epoch)
            if e is None:
                raise ValueError(f"routing entry of layer {layer} slot {slot} is stale (not step {epoch}'s tag)")
            if e != isa.NO_EXPERT:
                experts.append(e)
        out.append(torch.tensor(sorted(experts), dtype=torch.int64).reshape(1, -1))
    return out


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
    if spec.is_moe:  # the launch that wrote the table moved the epoch on as it finished
        step.routing = lambda: routing_entries(dec.scratch.routed, dec.state.epoch - 1,  # type: ignore[attr-defined]
                                               spec.moe_layers)
    step.decoder = dec  # type: ignore[attr-defined]
    return step
