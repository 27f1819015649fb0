"""The peers of `mimw bench steps`: a multi-token step (decode batch or verify blocks) run by something other than
mimw's backend under test, over the same tokens, positions and cache contents, so its logits can be compared.

  reference      mimw's ReferenceBackend over the same paged cache, eager; its slot arithmetic syncs the host, so
                 it cannot be graph-captured: timed for scale, never counted as a competitor
  torch-graph    BatchedDecoder (gpt-fast-style, static caches), eager kernels captured in one CUDA graph per shape
  torch-compile  BatchedDecoder under torch.compile(mode="max-autotune-no-cudagraphs", fullgraph=True,
                 dynamic=False) with the batch-1 max-autotune peer's Inductor settings (``torch_peers``: unique
                 kernel names, coordinate-descent tuning, applied with ``config.patch``, no global state), captured
                 in a manual CUDA graph; every buffer and the token/position inputs are static addresses

The torch peers build one module per step shape (B sequences x T tokens), its caches [B, Hkv, S, hd] with
S = the largest context + T rounded up to 16, filled from the paged cache (``BatchedDecoder.load_paged``), its
weights the backend's ``FusedWeights`` (no copy). ``build_peer`` raises ``Unavailable`` where a peer cannot run
(no CUDA, a mixture-of-experts model); ``StepPeer.release`` frees what a compile left behind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...prefill.weights import FusedWeights
from .base import Unavailable
from .batched_decoder import BatchedDecoder

COMPETITORS = ("torch-graph", "torch-compile")  # the peers mimw's speedup is taken over ("x best peer")


def parse_peers(text: str) -> tuple[str, ...]:
    """Comma list of peer names -> names in run order (``PEERS``' order, each once); unknown names raise."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    return tuple(n for n in PEERS if n in names)


@dataclass(frozen=True)
class StepInputs:
    """One step as the backend under test runs it: ``tokens`` [sum(lengths)] (segments' tokens concatenated)."""

    tokens: torch.Tensor
    segments: tuple[Segment, ...]
    cache: PagedKVCache


@dataclass
class StepPeer:
    """``step()`` enqueues one step on the current stream; ``logits()`` returns its logits as ``Backend.forward``
    does: fp32 [sum(num_logits), V], each segment's last ``num_logits`` rows in segment order."""

    step: Callable[[], None]
    logits: Callable[[], torch.Tensor]
    notes: str
    release: Callable[[], None] = field(default=lambda: None)
    # what a captured graph reads and writes in place (the module with its static caches, the step's tokens and
    # positions): held as long as the peer, since a graph keeps only its own pool alive and freed inputs would be
    # reused by later allocations under its replays
    keep: tuple = ()


def cache_len(segments: Sequence[Segment]) -> int:
    """Static cache rows for a step: the largest context plus the block, rounded up to 16."""
    return -(-(max(s.start for s in segments) + segments[0].length) // 16) * 16


def step_module(w: FusedWeights, inp: StepInputs) -> tuple[BatchedDecoder, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module for this step shape, its caches loaded from ``inp.cache``; (module, tokens [B, T], positions
    [B, T], logit rows [sum(num_logits)] into the [B*T] flattened output)."""
    if w.spec.is_moe:
        raise Unavailable("the batched PyTorch decoder has no mixture-of-experts block")
    segs = inp.segments
    t = segs[0].length
    if any(s.length != t for s in segs):
        raise ValueError(f"the batched decoder runs B x T blocks: segments of lengths {[s.length for s in segs]}")
    m = BatchedDecoder(w, len(segs), cache_len(segs))
    m.load_paged(inp.cache, [s.block_table for s in segs], [s.start for s in segs])
    dev = w.device
    tokens = inp.tokens.to(dev).view(len(segs), t).clone()  # the step's own storage: graphs read it in place
    pos = (torch.tensor([s.start for s in segs])[:, None] + torch.arange(t)[None, :]).to(dev)
    rows = torch.tensor([b * t + j for b, s in enumerate(segs) for j in range(t - s.num_logits, t)], device=dev)
    return m, tokens, pos, rows


def _selected(out: torch.Tensor, rows: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: out.reshape(-1, out.shape[-1])[rows].float()


def _require_cuda(w: FusedWeights, what: str) -> None:
    if w.device.type != "cuda":
        raise Unavailable(f"{what} needs the weights on a CUDA device")


def reference_peer(w: FusedWeights, inp: StepInputs) -> StepPeer:
    from ...engine.backends.reference import ReferenceBackend

    be = ReferenceBackend(w.unfused())  # row views of the fused tensors: no copy
    out: list[torch.Tensor] = []

    def step() -> None:
        out[:] = [be.forward(inp.tokens, inp.segments, inp.cache)]

    return StepPeer(step, lambda: out[0], "mimw reference decoder, eager (host-synced slot math)")


def torch_graph_peer(w: FusedWeights, inp: StepInputs) -> StepPeer:
    from .graph import capture

    _require_cuda(w, "CUDA-graph capture")
    m, tokens, pos, rows = step_module(w, inp)
    with torch.no_grad():
        graph, out = capture(lambda: m(tokens, pos))
    return StepPeer(graph.replay, _selected(out, rows), "eager kernels, one CUDA graph per step shape",
                    keep=(m, tokens, pos))


def torch_compile_peer(w: FusedWeights, inp: StepInputs) -> StepPeer:
    import torch._dynamo
    import torch._inductor.config

    from .graph import capture
    from .torch_peers import _INDUCTOR_MAX

    _require_cuda(w, "torch.compile peers")
    # a fresh dynamo state per shape: no reuse of another shape's code, no automatic dynamic shapes, no recompile
    # limit reached across the run's shapes
    torch._dynamo.reset()
    m, tokens, pos, rows = step_module(w, inp)
    for t in (*m.buffers(), tokens, pos):  # the step's inputs never move: no copy-in per replay
        torch._dynamo.mark_static_address(t)
    fn = torch.compile(m, mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(_INDUCTOR_MAX), torch.no_grad():
        fn(tokens, pos)  # compile + autotune on the default stream, outside any capture
        torch.cuda.synchronize()
        graph, out = capture(lambda: fn(tokens, pos))
    return StepPeer(graph.replay, _selected(out, rows),
                    "inductor max-autotune GEMMs + coordinate-descent, manual CUDA graph", torch._dynamo.reset,
                    keep=(m, fn, tokens, pos))


BUILDERS: dict[str, Callable[[FusedWeights, StepInputs], StepPeer]] = {
    "reference": reference_peer,
    "torch-graph": torch_graph_peer,
    "torch-compile": torch_compile_peer,
}
PEERS = tuple(BUILDERS)  # run order


def build_peer(name: str, w: FusedWeights, inp: StepInputs) -> StepPeer:
    if name not in BUILDERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return BUILDERS[name](w, inp)
