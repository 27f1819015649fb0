"""What every instruction's reference solver shares: the context it runs in, and the RMSNorm of its input rows.

A solver is ``solve(ctx, ins)`` (and, for an instruction with a finisher, ``finish(ctx, ins)``): it reads and
writes exactly the buffers its GPU instruction touches (the contract in ``megakernel/state.py``), in place, and
returns nothing. Scratch, step state and the KV cache all live in ``ctx``; in a tensor-parallel step so does the
rank's view of peer memory (``ctx.peers``: stores into every rank's inbox, reads of its own; megakernel/peers.py).

Numerics (so that a bf16 GPU kernel can match bit for bit where it matters): everything is computed in fp32 with
weights upcast, except
  * the RMSNorm output, rounded to the weight dtype before the norm-weight multiply, as the reference decoder does:
        h = (x * rsqrt(mean(x^2) + eps)).to(wdtype) * norm_w          (input norms, q/k head norms, final norm)
  * K and V, stored in the cache's format (rounded to its dtype, or fp8 with a scale per row: kv/pages.py).
The multi-token GPU kernel (device/matvec_mt.py) normalises x rounded to bf16 (its x16 copy, as transformers' bf16
residual stream holds it): within bf16 rounding of this reference, not bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...kv.pages import PagedKVCache
    from ...models.spec import ModelSpec
    from ...models.weights import ModelWeights
    from ..peers import PeerView
    from ..program import Program
    from ..state import Scratch, StepState


@dataclass(frozen=True)
class OpContext:
    """Everything an instruction may read or write during one step."""

    program: Program
    weights: ModelWeights
    cache: PagedKVCache
    state: StepState
    scratch: Scratch
    peers: PeerView | None = None  # tensor parallelism: this rank's view of the inboxes (None: one GPU)

    @property
    def spec(self) -> ModelSpec:
        return self.program.spec


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] fp32, w [n] in the weight dtype -> fp32 [..., n]; the normalised x is rounded to w's dtype."""
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (xn.to(w.dtype) * w).float()


def residual(ctx: OpContext, layer: int, cols: slice = slice(None)) -> torch.Tensor:
    """The residual stream entering ``layer``, columns ``cols``: [M, n] fp32.

    Layer 0 reads each token's embedding row (there is no separate embedding pass); later layers read scratch.x,
    which the previous layer's DOWN_PROJ instructions completed."""
    if layer == 0:
        tokens = ctx.state.tokens.long()
        return ctx.weights.embed[tokens, cols].float()
    return ctx.scratch.x[:, cols]


def matvec(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h [M, K] fp32 times the weight rows w [n, K] (any dtype, upcast) -> [M, n] fp32."""
    return h @ w.float().t()


def activation_in(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An fp32 activation (attention output, MLP activation) as a matvec input: rounded to the weight dtype, as the
    GPU kernel stages it (bf16 in shared memory) and as the reference decoder holds it; a no-op for fp32 weights."""
    return a.to(w.dtype).float()


def routed_expert(ctx: OpContext, layer: int, slot: int) -> int:
    """The expert routing slot ``slot`` of ``layer`` holds in this step (isa.NO_EXPERT: unused), read from the
    routing table as the loader and compute read it (isa.routed_expert)."""
    from .. import isa

    e = isa.routed_expert(int(ctx.scratch.routed[layer, slot]), ctx.state.epoch)
    if e is None:
        raise RuntimeError(f"routing slot {slot} of layer {layer} read before this step's router wrote it")
    return e
