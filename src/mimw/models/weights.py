"""ModelWeights: the tensors of a decoder, named by role rather than by checkpoint key.

Shapes (D = hidden_size, I = intermediate_size, Q = num_heads*head_dim, KV = num_kv_heads*head_dim; MoE: E =
num_experts, F = moe_intermediate_size):
  embed [V, D]; per layer: attn_norm [D], wq [Q, D], wk [KV, D], wv [KV, D], bq [Q]?, bk [KV]?, bv [KV]?,
  q_norm [hd]?, k_norm [hd]?, wo [D, Q], mlp_norm [D], then either a dense MLP w_gate [I, D], w_up [I, D],
  w_down [D, I], or (an MoE layer, ``spec.is_moe_layer``) the router [E, D] and the experts stacked
  e_gate [E, F, D], e_up [E, F, D], e_down [E, D, F];
  final_norm [D]; lm_head [V, D] (the same tensor object as ``embed`` when embeddings are tied).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .spec import ModelSpec


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor | None = None  # dense MLP (None on an MoE layer)
    w_up: torch.Tensor | None = None
    w_down: torch.Tensor | None = None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE layer: [E, D]
    e_gate: torch.Tensor | None = None  # [E, F, D]
    e_up: torch.Tensor | None = None  # [E, F, D]
    e_down: torch.Tensor | None = None  # [E, D, F]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class ModelWeights:
    spec: ModelSpec
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def expected_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        return expected_layer_shapes(self.spec, layer)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ModelWeights":
        """A copy on ``device`` / in ``dtype`` (norm weights included); keeps embed/lm_head tied when they were."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        embed = mv(self.embed)
        lm_head = embed if self.lm_head is self.embed else mv(self.lm_head)
        layers = [LayerWeights(**{k: mv(v) for k, v in lw.tensors().items()}) for lw in self.layers]
        return ModelWeights(self.spec, embed, layers, mv(self.final_norm), lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def expected_layer_shapes(spec: ModelSpec, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Role -> shape of every tensor of ``layer`` (an MoE layer's experts, a dense layer's MLP)."""
    d, i, q, kv, hd = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size, spec.head_dim
    shapes = {"attn_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "mlp_norm": (d,)}
    if spec.is_moe_layer(layer):
        e, f = spec.num_experts, spec.moe_intermediate_size
        shapes.update(router=(e, d), e_gate=(e, f, d), e_up=(e, f, d), e_down=(e, d, f))
    else:
        shapes.update(w_gate=(i, d), w_up=(i, d), w_down=(d, i))
    if spec.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if spec.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def random_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> ModelWeights:
    """Random weights at the spec's shapes, deterministic in ``seed``.

    Scaled like a trained model's activations stay O(1): matrices ~ N(0, 1/fan_in), norms ~ 1 + small noise, so
    that logits are neither flat nor saturated and argmax comparisons are meaningful.
    """
    # drawn on the target device (GBs at 8B shapes), deterministic per (seed, device type)
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(*shape: int) -> torch.Tensor:  # [..., rows, cols]: every row ~ N(0, 1/cols)
        t = torch.empty(*shape, device=device, dtype=dtype)
        return t.normal_(0.0, shape[-1] ** -0.5, generator=g)

    def vec(n: int, center: float = 1.0, scale: float = 0.1) -> torch.Tensor:
        return torch.empty(n, device=device, dtype=dtype).normal_(center, scale, generator=g)

    layers = []
    for layer in range(spec.num_layers):
        shapes = expected_layer_shapes(spec, layer)
        t: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if len(shape) >= 2:
                t[name] = mat(*shape)
            elif name.startswith("b"):
                t[name] = vec(shape[0], 0.0, 0.5)
            else:
                t[name] = vec(shape[0])
        layers.append(LayerWeights(**t))
    embed = torch.empty(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype).normal_(0.0, 1.0, generator=g)
    lm_head = embed if spec.tie_word_embeddings else mat(spec.vocab_size, spec.hidden_size)
    return ModelWeights(spec, embed, layers, vec(spec.hidden_size), lm_head)
