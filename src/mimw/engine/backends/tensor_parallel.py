"""Tensor-parallel serving: N processes (torchrun), one rank each; rank 0 runs the engine, every rank runs each step.

``TPReferenceBackend``  a rank's reference backend: ``ReferenceDecoder`` over the rank's shard of the model
    (megakernel/tensor_parallel.py: its KV-head groups, intermediate and vocabulary rows), whose o and down
    projections' partial sums are all-reduced and whose logits are all-gathered (``join`` / ``gather``), so every
    rank computes the whole model's logits. Its ``spec`` is the whole model's (the engine samples the whole
    vocabulary); its KV cache holds the rank's heads only.
``Leader``  what rank 0's engine drives: each ``make_cache`` and ``forward`` goes to the followers first, then runs
    on rank 0's own backend. A step's segments travel as objects over a gloo group (host data), its tokens by a
    broadcast on the backend's own group (on the device, in stream order: tokens the engine has not read back yet
    stay unread on the host).
``follow``  a follower's loop: run what the leader sends, in the same order, until ``Leader.close``;
    ``control_group`` the gloo group both sides send the host messages on.

The KV cache is changed only by ``forward``, so every rank's cache holds its heads of the same pages; the engine's
host KV tier, which copies pages outside ``forward``, is not run with tensor parallelism (``check`` refuses it).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...kv.pages import KVLayout, PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.weights import ModelWeights
from .base import Backend
from .reference import ReferenceBackend

_CACHE, _FORWARD, _STOP = "cache", "forward", "stop"


class TPReferenceBackend(ReferenceBackend):
    """Rank ``dist.get_rank(group)`` of ``dist.get_world_size(group)`` over ``weights`` (the whole model): the
    reference backend over the rank's shard (``self.weights``), its decoder joining the ranks' partials."""

    def __init__(self, weights: ModelWeights, group=None, kv_dtype: torch.dtype | None = None):
        import torch.distributed as dist

        from ...megakernel.tensor_parallel import TensorParallel, shard_weights

        self.group = group or dist.group.WORLD
        self.rank = TensorParallel(weights.spec, dist.get_rank(self.group), dist.get_world_size(self.group))
        super().__init__(shard_weights(weights, self.rank), kv_dtype)
        self.spec = weights.spec  # the whole model's: the engine samples the whole vocabulary
        self._decoder = ReferenceDecoder(self.weights, join=self._join, gather=self._gather)

    def _join(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        dist.all_reduce(t, group=self.group)  # the ranks' partials summed (every rank the same result)
        return t

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.rank.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)  # the vocabulary's rows in rank order

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        """The rank's KV heads of every page."""
        return PagedKVCache(KVLayout.for_spec(self.weights.spec, page_size, num_pages, self.kv_dtype), self.device)


class Leader(Backend):
    """Rank 0's view of a tensor-parallel backend (``inner``): every call is sent to the followers first."""

    def __init__(self, inner: TPReferenceBackend, control):
        self.inner, self.spec = inner, inner.spec
        self.control = control  # ``control_group()``: the host messages' group
        self.closed = False

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.inner.kv_dtype

    def _send(self, message: tuple) -> None:
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError("the tensor-parallel followers were stopped")
        dist.broadcast_object_list([message], src=0, group=self.control)

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        self._send((_CACHE, page_size, num_pages))
        return self.inner.make_cache(page_size, num_pages)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        import torch.distributed as dist

        self._send((_FORWARD, tuple(segments)))
        tokens = tokens.to(torch.int64).contiguous()
        dist.broadcast(tokens, src=0, group=self.inner.group)
        return self.inner.forward(tokens, segments, cache)

    def close(self) -> None:
        """Stop the followers (their ``follow`` returns)."""
        if not self.closed:
            self._send((_STOP,))
            self.closed = True


def control_group():
    """The group the leader's host messages travel on (gloo, whatever the backend's group is); every rank calls it
    once, in the same order as its other group creations."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def follow(backend: TPReferenceBackend, control) -> int:
    """A follower rank: run every cache and step the leader sends, until it stops; returns the steps run."""
    import torch.distributed as dist

    cache, steps = None, 0
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        kind, *rest = box[0]
        if kind == _STOP:
            return steps
        if kind == _CACHE:
            cache = backend.make_cache(*rest)
            continue
        segments = rest[0]
        tokens = torch.empty(sum(s.length for s in segments), dtype=torch.int64, device=backend.device)
        dist.broadcast(tokens, src=0, group=backend.group)
        backend.forward(tokens, segments, cache)
        steps += 1


__all__ = ["TPReferenceBackend", "Leader", "control_group", "follow"]
