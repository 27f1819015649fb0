"""The PyTorch peers: one ``FusedDecoder`` run four ways.

  torch-eager                    the module as is, one kernel launch per op (launch-bound at batch 1)
  torch-eager-graph              the same kernels captured once in a CUDA graph and replayed
  torch-compile-reduce-overhead  torch.compile(mode="reduce-overhead", fullgraph=True): Inductor kernels, replayed
                                 by Inductor's own CUDA graphs (cudagraph trees) — gpt-fast's configuration
  torch-compile-max-autotune     torch.compile(mode="max-autotune-no-cudagraphs", fullgraph=True): Inductor with GEMM
                                 autotuning, captured in a manual CUDA graph (same effect as mode="max-autotune",
                                 without a second cudagraph layer we cannot see into)

Inductor settings are applied with ``torch._inductor.config.patch`` around the compile and first calls only (no
global state): both peers get gpt-fast's ``triton.unique_kernel_names``; the max-autotune peer also gets its
``coordinate_descent_tuning`` (tunes every pointwise/reduction kernel: best code, longest compile), while the
reduce-overhead peer stays at Inductor's defaults so that one compiled peer is cheap to build within the GPU budget.
Every module buffer (KV cache, RoPE tables, positions) and the token/position inputs are marked static addresses so that the CUDA graphs read and
mutate them in place instead of copying them in on every replay.
"""
from __future__ import annotations

import torch

from .base import Peer, PeerContext, cache_len_for, require_cuda
from .graph import capture, inductor_cudagraph_skips
from .torch_decoder import FusedDecoder

_INDUCTOR = {"triton.unique_kernel_names": True}
_INDUCTOR_MAX = {**_INDUCTOR, "coordinate_descent_tuning": True}


def _module(ctx: PeerContext) -> tuple[FusedDecoder, torch.Tensor, torch.Tensor]:
    m = FusedDecoder(ctx.bw, cache_len_for(ctx.inputs.context))
    m.load_prefix(ctx.inputs)
    tok = torch.tensor([ctx.inputs.token], device=ctx.device)
    pos = torch.tensor([ctx.inputs.context], device=ctx.device)
    return m, tok, pos


def torch_eager(ctx: PeerContext) -> Peer:
    m, tok, pos = _module(ctx)
    out: list[torch.Tensor | None] = [None]

    def step() -> None:
        out[0] = m(tok, pos)

    return Peer(step, lambda: out[0], "fused qkv/gate-up, static KV buffers", routing=m.routing)


def torch_eager_graph(ctx: PeerContext) -> Peer:
    require_cuda(ctx, "CUDA-graph capture")
    m, tok, pos = _module(ctx)
    graph, logits = capture(lambda: m(tok, pos))
    return Peer(graph.replay, lambda: logits, "eager kernels, one CUDA graph per step", keep=(m, tok, pos),
                routing=m.routing)


def _compiled(ctx: PeerContext, mode: str):
    require_cuda(ctx, "torch.compile peers")
    import torch._dynamo
    import torch._inductor.config  # noqa: F401  (config.patch below)

    torch._dynamo.reset()  # a fresh cache: otherwise a second compile of forward may reuse the first's code
    m, tok, pos = _module(ctx)
    for t in (*m.buffers(), tok, pos):  # the step's inputs never move either: no copy-in per replay
        torch._dynamo.mark_static_address(t)
    return torch.compile(m, mode=mode, fullgraph=True), tok, pos  # the compiled module holds m


def torch_compile_reduce_overhead(ctx: PeerContext) -> Peer:
    fn, tok, pos = _compiled(ctx, "reduce-overhead")
    out: list[torch.Tensor | None] = [None]
    skips = inductor_cudagraph_skips()

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        out[0] = fn(tok, pos)

    with torch._inductor.config.patch(_INDUCTOR):
        for _ in range(3):  # compile, record the cudagraph tree, replay
            step()
        torch.cuda.synchronize()
    graphs = "cudagraph trees" if inductor_cudagraph_skips() == skips else "CUDA graphs SKIPPED by inductor (see log)"
    return Peer(step, lambda: out[0], f"inductor + {graphs}", routing=fn._orig_mod.routing)


def torch_compile_max_autotune(ctx: PeerContext) -> Peer:
    fn, tok, pos = _compiled(ctx, "max-autotune-no-cudagraphs")
    with torch._inductor.config.patch(_INDUCTOR_MAX):
        fn(tok, pos)  # compile + autotune on the default stream, outside any capture
        torch.cuda.synchronize()
        graph, logits = capture(lambda: fn(tok, pos))
    return Peer(graph.replay, lambda: logits, "inductor max-autotune GEMMs + coordinate-descent, manual CUDA graph",
                keep=(fn, tok, pos), routing=fn._orig_mod.routing)
