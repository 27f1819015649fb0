"""mimw's own backends: the reference decoder and (when it exists) the megakernel.

mimw-reference: ``ReferenceDecoder`` over a ``PagedKVCache`` (fp8 with ``--kv-dtype fp8``), eager. It is not
CUDA-graph capturable: its slot arithmetic reads ``positions.max()`` on the host (a device sync) every layer. It is
the oracle the other backends are checked against, timed for scale only. It reports its routing (the ``routings`` its
forward hands out anyway).

mimw-megakernel: ``mimw.megakernel.bench_backend.make_step(spec, weights, context, options, inputs)`` returns a
zero-argument callable that runs one decode step (graph-captured/replayed inside); ``options`` are plan.Tuning
overrides ("NAME=VALUE,...", ``--megakernel``). Contract, beyond the call itself:
  - the KV cache holds ``inputs`` (the run's ``mimw.bench.inputs.decode_inputs``) at positions 0..C-1 and the step
    decodes ``inputs.token`` at position C, so that its logits can be checked against the reference;
  - the callable may carry ``logits``: a tensor ([V] or [1, V]) the step overwrites, or a zero-argument function
    returning it. Without it the row is reported "unchecked";
  - an MoE model's callable may carry ``routing``: a zero-argument function returning the last step's experts per
    MoE layer (``Peer.routing``); without it its logits are checked against every near-tie routing.
ImportError / NotImplementedError from the import or from ``make_step`` mean "unavailable: <reason>". It gets the
run's inputs (an fp8 run's included: ``inputs.kv_dtype``, the kernel then reads and writes e4m3 pages with scales).
An MoE model runs (one token a step, the megakernel's MoE layers) over a bf16 cache (an fp8 run of one is
unavailable: plan.py refuses the pair); its logits are checked against the reference forced onto its own routing
(``mimw.bench.own_route``), as every backend's that reports one are.
"""
from __future__ import annotations

import torch

from ...models.reference import ReferenceDecoder, Segment
from ..inputs import paged_cache
from .base import Peer, PeerContext, Unavailable


def mimw_reference(ctx: PeerContext) -> Peer:
    spec, inp = ctx.bw.spec, ctx.inputs
    cache, table = paged_cache(spec, inp)
    dec = ReferenceDecoder(ctx.bw.weights)
    tok = torch.tensor([inp.token], device=ctx.device)
    seg = [Segment(table, inp.context, 1)]
    out: list[torch.Tensor | None] = [None]
    routings: list = []

    def step() -> None:
        routings.clear()
        out[0] = dec.forward(tok, seg, cache, routings=routings)

    return Peer(step, lambda: out[0], "eager (host-synced slot math: not graph-capturable)",
                routing=lambda: [r.ids.clone() for r in routings] if spec.is_moe else None)


def mimw_megakernel(ctx: PeerContext) -> Peer:
    if ctx.bw.spec.is_moe and ctx.inputs.kv_dtype not in (None, torch.bfloat16):
        raise Unavailable("the megakernel runs a mixture-of-experts model over a bf16 KV cache only (plan.py)")
    try:
        from ...megakernel.bench_backend import make_step
    except ImportError as e:
        raise Unavailable(f"mimw.megakernel.bench_backend: {e}") from None
    try:
        step = make_step(ctx.bw.spec, ctx.bw.weights, ctx.inputs.context, ctx.megakernel, ctx.inputs)
    except (ImportError, NotImplementedError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from None
    logits = getattr(step, "logits", None)
    notes = f"tuning overrides: {ctx.megakernel}" if ctx.megakernel else ""
    routing = getattr(step, "routing", lambda: None)
    if logits is None:
        return Peer(step, lambda: None, "; ".join(n for n in ("no logits exposed: unchecked", notes) if n))
    if isinstance(logits, torch.Tensor):
        return Peer(step, lambda: logits, notes, routing=routing)
    return Peer(step, logits, notes, routing=routing)
