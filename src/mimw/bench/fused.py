"""BenchWeights: one weight set shared by every backend of a benchmark run, with fused projections.

The gpt-fast recipe multiplies once per layer by a fused ``wqkv`` [Q+2KV, D] and a fused ``w_gate_up`` [2I, D].
Other backends (the reference decoder, transformers, the megakernel) want ``wq``/``wk``/``wv``/``w_gate``/``w_up``
separately. Here the separate tensors are *row views* of the fused ones, so both layouts cost the memory of one
(8B in bf16 is 16 GB; the H200 has 141 GB, but five copies would not fit).

Invariant: for every layer, ``layers[i].wq``, ``.wk``, ``.wv`` are consecutive row blocks of ``wqkv[i]`` (contiguous,
same storage) and ``w_gate``, ``w_up`` of ``w_gate_up[i]``; ``bq``/``bk``/``bv`` likewise of ``bqkv[i]`` when the
architecture has biases. An MoE layer has no ``w_gate_up`` (None): its router and stacked experts are kept as they
are.

``random_bench_weights`` generates directly on the target device (a CUDA ``normal_`` per tensor with its own seeded
generator: 16 GB in well under a second) with the same distributions as ``mimw.models.weights.random_weights``
(matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.01), biases ~ N(0, 0.25), embedding ~ N(0, 1)), not the same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.spec import ModelSpec
from ..models.weights import LayerWeights, ModelWeights


@dataclass
class BenchWeights:
    weights: ModelWeights               # separate tensors: views into the fused ones below
    wqkv: list[torch.Tensor]            # per layer [Q+2KV, D]
    bqkv: list[torch.Tensor | None]     # per layer [Q+2KV] (qwen2) or None
    w_gate_up: list[torch.Tensor | None]  # per layer [2I, D] (None: an MoE layer)

    @property
    def spec(self) -> ModelSpec:
        return self.weights.spec


def _split_layer(spec: ModelSpec, lw: LayerWeights, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                 w_gate_up: torch.Tensor | None) -> LayerWeights:
    q, kv, i = spec.q_size, spec.kv_size, spec.intermediate_size
    wq, wk, wv = wqkv.split([q, kv, kv])
    bq = bk = bv = None
    if bqkv is not None:
        bq, bk, bv = bqkv.split([q, kv, kv])
    w_gate, w_up = w_gate_up.split([i, i]) if w_gate_up is not None else (None, None)
    return LayerWeights(attn_norm=lw.attn_norm, wq=wq, wk=wk, wv=wv, wo=lw.wo, mlp_norm=lw.mlp_norm,
                        w_gate=w_gate, w_up=w_up, w_down=lw.w_down, bq=bq, bk=bk, bv=bv,
                        q_norm=lw.q_norm, k_norm=lw.k_norm, router=lw.router, e_gate=lw.e_gate, e_up=lw.e_up,
                        e_down=lw.e_down)


def fuse(weights: ModelWeights) -> BenchWeights:
    """Fused copies of q/k/v and gate/up; the returned ``weights`` views them (the originals can be dropped)."""
    spec = weights.spec
    wqkv, bqkv, wgu, layers = [], [], [], []
    for lw in weights.layers:
        a = torch.cat([lw.wq, lw.wk, lw.wv])
        b = torch.cat([lw.bq, lw.bk, lw.bv]) if lw.bq is not None else None
        g = torch.cat([lw.w_gate, lw.w_up]) if lw.w_gate is not None else None
        wqkv.append(a), bqkv.append(b), wgu.append(g)
        layers.append(_split_layer(spec, lw, a, b, g))
    mw = ModelWeights(spec, weights.embed, layers, weights.final_norm, weights.lm_head)
    return BenchWeights(mw, wqkv, bqkv, wgu)


def random_bench_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         device: torch.device | str = "cuda") -> BenchWeights:
    """Random weights generated on ``device``, deterministic in ``seed`` on a given device type."""
    counter = [0]

    def gen() -> torch.Generator:
        counter[0] += 1
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + counter[0])

    def normal(shape: tuple[int, ...], mean: float, std: float) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(mean, std, generator=gen())

    d, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    e, f = spec.num_experts, spec.moe_intermediate_size
    std_d, std_i = d ** -0.5, i ** -0.5
    wqkv, bqkv, wgu, layers = [], [], [], []
    for layer in range(spec.num_layers):
        a = normal((q + 2 * kv, d), 0.0, std_d)
        b = normal((q + 2 * kv,), 0.0, 0.5) if spec.attention_bias else None
        moe = spec.is_moe_layer(layer)
        g = None if moe else normal((2 * i, d), 0.0, std_d)
        # drawn in the same order as before MoE existed, so a dense preset's weights keep their values
        attn_norm, wo, mlp_norm = normal((d,), 1.0, 0.1), normal((d, q), 0.0, q ** -0.5), normal((d,), 1.0, 0.1)
        if moe:
            mlp = dict(router=normal((e, d), 0.0, std_d), e_gate=normal((e, f, d), 0.0, std_d),
                       e_up=normal((e, f, d), 0.0, std_d), e_down=normal((e, d, f), 0.0, f ** -0.5))
        else:
            mlp = dict(w_gate=g, w_up=g, w_down=normal((d, i), 0.0, std_i))
        qn = normal((spec.head_dim,), 1.0, 0.1) if spec.qk_norm else None
        kn = normal((spec.head_dim,), 1.0, 0.1) if spec.qk_norm else None
        lw = LayerWeights(attn_norm=attn_norm, wq=a, wk=a, wv=a, wo=wo, mlp_norm=mlp_norm, q_norm=qn, k_norm=kn, **mlp)
        wqkv.append(a), bqkv.append(b), wgu.append(g)
        layers.append(_split_layer(spec, lw, a, b, g))
    embed = normal((spec.vocab_size, d), 0.0, 1.0)
    lm_head = embed if spec.tie_word_embeddings else normal((spec.vocab_size, d), 0.0, std_d)
    mw = ModelWeights(spec, embed, layers, normal((d,), 1.0, 0.1), lm_head)
    return BenchWeights(mw, wqkv, bqkv, wgu)
