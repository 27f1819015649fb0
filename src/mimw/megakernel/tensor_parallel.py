"""Tensor parallelism as a transformation: which heads and rows rank r of N holds, its shard of the model's shape,
weights and KV cache (docs/megakernel.md, "Tensor parallelism").

Rank r holds KV heads [r Hkv/N, (r+1) Hkv/N) and their query heads (a GQA group is never split), intermediate rows
[r I/N, (r+1) I/N) and vocabulary rows [r V/N, (r+1) V/N); the embedding table, the norms and the residual stream
are replicated. Its shard is a model of its own shape (``shard_spec``: Hq/N, Hkv/N heads, I/N, V/N), so every
instruction, buffer and tile array of the rank's program is the one-GPU one at that shape; only O_PROJ, DOWN_PROJ
and LM_HEAD hand their results to the peers (isa.PEER) and REDUCE joins them. Every rank's program is therefore
the same words; a rank differs only in its weights, its KV cache and which inbox slot its partials go to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..kv.pages import KVLayout, PagedKVCache
from ..models.spec import ModelSpec
from ..models.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` over ``spec`` (the whole model); refuses a split that is not whole (see ``check``)."""

    spec: ModelSpec
    rank: int
    size: int
    tile_rows: int = 32

    def __post_init__(self):
        check(self.spec, self.size, self.tile_rows)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def _range(self, n: int) -> slice:
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    @property
    def q_heads(self) -> slice:
        return self._range(self.spec.num_heads)

    @property
    def kv_heads(self) -> slice:
        return self._range(self.spec.num_kv_heads)

    @property
    def mlp_rows(self) -> slice:
        return self._range(self.spec.intermediate_size)

    @property
    def vocab_rows(self) -> slice:
        return self._range(self.spec.vocab_size)


def check(spec: ModelSpec, size: int, tile_rows: int = 32) -> None:
    """Raise ValueError unless ``size`` ranks split ``spec`` into whole shards: an MoE model is refused (expert
    parallelism is another design); KV heads split evenly (a rank keeps whole GQA groups); each rank's intermediate
    rows are whole MLP_IN granules (tile_rows / 2: a gate/up tile holds half a tile of each) and its vocabulary rows
    whole row tiles."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {size}")
    if size == 1:
        return
    if spec.is_moe:
        raise ValueError(f"{spec.name}: tensor parallelism does not support mixture-of-experts models")
    if spec.num_kv_heads % size:
        raise ValueError(f"{spec.name}: {spec.num_kv_heads} KV heads do not split over {size} ranks (a rank holds "
                         "whole GQA groups: the KV head count must be a multiple of the tensor-parallel size)")
    for what, rows, granule in (("intermediate", spec.intermediate_size, tile_rows // 2),
                                ("vocabulary", spec.vocab_size, tile_rows)):
        if rows % (size * granule):
            raise ValueError(f"{spec.name}: {rows} {what} rows do not split over {size} ranks into whole "
                             f"{granule}-row tiles")


def shard_spec(spec: ModelSpec, size: int, tile_rows: int = 32) -> ModelSpec:
    """The shape of one rank's shard: Hq/N and Hkv/N heads, I/N intermediate rows, V/N vocabulary rows (its
    lm_head shard; the embedding table stays whole, so embeddings are never tied in a shard)."""
    check(spec, size, tile_rows)
    if size == 1:
        return spec
    return spec.with_(name=f"{spec.name}/tp{size}", num_heads=spec.num_heads // size,
                      num_kv_heads=spec.num_kv_heads // size, intermediate_size=spec.intermediate_size // size,
                      vocab_size=spec.vocab_size // size, tie_word_embeddings=False)


def shard_weights(weights: ModelWeights, tp: TensorParallel) -> ModelWeights:
    """Rank ``tp.rank``'s weights (views, no copies): its heads' rows of wq/wk/wv (and biases), their columns of wo,
    its intermediate rows of w_gate/w_up and columns of w_down, its vocabulary rows of lm_head; embed and norms
    whole."""
    spec, hd = tp.spec, tp.spec.head_dim
    if weights.spec != spec:
        raise ValueError(f"weights of {weights.spec.name} do not match the tensor-parallel spec {spec.name}")
    q = slice(tp.q_heads.start * hd, tp.q_heads.stop * hd)
    kv = slice(tp.kv_heads.start * hd, tp.kv_heads.stop * hd)
    i = tp.mlp_rows

    def opt(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
        return None if t is None else t[rows]

    layers = [LayerWeights(attn_norm=lw.attn_norm, wq=lw.wq[q], wk=lw.wk[kv], wv=lw.wv[kv], wo=lw.wo[:, q],
                           mlp_norm=lw.mlp_norm, w_gate=lw.w_gate[i], w_up=lw.w_up[i], w_down=lw.w_down[:, i],
                           bq=opt(lw.bq, q), bk=opt(lw.bk, kv), bv=opt(lw.bv, kv), q_norm=lw.q_norm,
                           k_norm=lw.k_norm)
              for lw in weights.layers]
    return ModelWeights(shard_spec(spec, tp.size, tp.tile_rows), weights.embed, layers, weights.final_norm,
                        weights.lm_head[tp.vocab_rows])


def shard_cache(cache: PagedKVCache, tp: TensorParallel) -> PagedKVCache:
    """A copy of rank ``tp.rank``'s KV heads of ``cache`` (same pages, same page size): the rank's cache shard."""
    lay = cache.layout
    out = PagedKVCache(KVLayout.for_spec(shard_spec(tp.spec, tp.size, tp.tile_rows), lay.page_size, lay.num_pages,
                                         lay.dtype), device=cache.k.device)
    for dst, src in zip(out.page_tensors(), cache.page_tensors()):
        dst.copy_(src[:, :, tp.kv_heads])
    return out


def place_shard(cache: PagedKVCache, pools: Sequence[torch.Tensor], tp: TensorParallel) -> None:
    """The inverse of ``shard_cache``: rank ``tp.rank``'s KV heads, ``pools`` (its shard's ``page_tensors()``), into
    ``cache`` (every head)."""
    for dst, src in zip(cache.page_tensors(), pools):
        dst[:, :, tp.kv_heads] = src


__all__ = ["TensorParallel", "check", "shard_spec", "shard_weights", "shard_cache", "place_shard"]
