"""FusedWeights: the prefill path's weights, with q/k/v and gate/up fused once at load so that each layer runs two
wide GEMMs instead of five narrow ones.

Per layer: ``wqkv`` [Q+2KV, D] (rows q, then k, then v), ``bqkv`` [Q+2KV] (qwen2) or None, ``w_gate_up`` [2I, D]
(rows gate, then up); the other tensors are the ``ModelWeights`` ones, shared, not copied. ``unfused()`` returns a
``ModelWeights`` whose wq/wk/wv/w_gate/w_up are row views of the fused tensors, so a backend that also needs the
separate tensors (the megakernel's packer) holds one copy of each weight, not two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.spec import ModelSpec
from ..models.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class FusedLayer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class FusedWeights:
    spec: ModelSpec
    embed: torch.Tensor
    layers: tuple[FusedLayer, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    tied: bool

    @classmethod
    def from_weights(cls, w: ModelWeights) -> "FusedWeights":
        layers = []
        for lw in w.layers:
            bqkv = torch.cat([lw.bq, lw.bk, lw.bv]) if lw.bq is not None else None
            layers.append(FusedLayer(lw.attn_norm, torch.cat([lw.wq, lw.wk, lw.wv]), bqkv, lw.q_norm, lw.k_norm,
                                     lw.wo, lw.mlp_norm, torch.cat([lw.w_gate, lw.w_up]), lw.w_down))
        return cls(w.spec, w.embed, tuple(layers), w.final_norm, w.lm_head, w.lm_head is w.embed)

    def unfused(self) -> ModelWeights:
        """The same weights as a ``ModelWeights``, its projections row views of the fused tensors."""
        s = self.spec
        q, kv, i = s.q_size, s.kv_size, s.intermediate_size
        layers = []
        for fl in self.layers:
            wq, wk, wv = fl.wqkv.split([q, kv, kv])
            bq, bk, bv = fl.bqkv.split([q, kv, kv]) if fl.bqkv is not None else (None, None, None)
            w_gate, w_up = fl.w_gate_up.split([i, i])
            layers.append(LayerWeights(attn_norm=fl.attn_norm, wq=wq, wk=wk, wv=wv, wo=fl.wo, mlp_norm=fl.mlp_norm,
                                       w_gate=w_gate, w_up=w_up, w_down=fl.w_down, bq=bq, bk=bk, bv=bv,
                                       q_norm=fl.q_norm, k_norm=fl.k_norm))
        lm_head = self.embed if self.tied else self.lm_head
        return ModelWeights(s, self.embed, layers, self.final_norm, lm_head)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype
