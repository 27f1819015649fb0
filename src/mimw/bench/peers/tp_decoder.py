"""TPFusedDecoder: the PyTorch peer of tensor parallelism, ``FusedDecoder`` (torch_decoder.py) on one rank's shard
with the collectives as vLLM and gpt-fast place them (Megatron-style): q/k/v and gate/up split by output rows
(column parallel: the rank's heads and intermediate rows), o and down by input columns (row parallel), each of those
two partials summed over the ranks by an all-reduce before the residual add, and the vocabulary split by rows, the
logits all-gathered. The shard is the megakernel's (megakernel/tensor_parallel.py: whole GQA groups a rank, the
embedding and norms replicated), so both run the same split; the collectives are torch's functional ones over the
process group (NCCL on GPUs, gloo on the CPU), which torch.compile traces and CUDA graphs capture.
"""
from __future__ import annotations

import torch

from ...megakernel.tensor_parallel import TensorParallel, shard_weights
from ...models.weights import ModelWeights
from ..fused import fuse
from ..inputs import DecodeInputs
from .torch_decoder import FusedDecoder


class TPFusedDecoder(FusedDecoder):
    """Rank ``tp.rank`` of ``tp.size`` over ``weights`` (the whole model): ``forward(token, pos)`` -> the whole
    vocabulary's logits [1, V] on every rank. Every rank of ``group`` runs each step."""

    def __init__(self, weights: ModelWeights, tp: TensorParallel, cache_len: int, group=None):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        super().__init__(fuse(shard_weights(weights, tp)), cache_len)
        self.tp, self.group = tp, group or dist.group.WORLD

        def join(t: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(t, "sum", self.group)

        def gather(t: torch.Tensor) -> torch.Tensor:  # [1, V/N] a rank -> [1, V], ranks in order; a plain tensor
            return funcol.wait_tensor(funcol.all_gather_tensor(t, gather_dim=t.dim() - 1, group=self.group))

        for layer in self.layers:
            layer.join = join
        self.gather = gather

    @torch.no_grad()
    def load_prefix(self, inputs: DecodeInputs) -> None:
        """The context's K/V of this rank's KV heads."""
        heads = self.tp.kv_heads
        super().load_prefix(DecodeInputs(inputs.token, inputs.context, inputs.k[:, :, heads], inputs.v[:, :, heads],
                                         inputs.kv_dtype))
