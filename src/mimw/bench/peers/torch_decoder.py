"""FusedDecoder: a gpt-fast-style PyTorch decoder, the module behind the torch eager / graph / compile peers.

What makes it the gpt-fast recipe (pytorch-labs/gpt-fast, ``model.py``/``generate.py``), written anew here:
  - one fused ``wqkv`` matmul and one fused ``w_gate_up`` matmul per layer (fewer, larger GEMVs);
  - a static KV cache held as module buffers, updated in place by index with a position *tensor*, so one compiled
    graph (and one CUDA graph) serves every step without recompiling or host syncs;
  - attention over the whole static cache with a mask ``arange(S) <= pos`` instead of a data-dependent slice.
Unlike gpt-fast it never materialises ``repeat_interleave``d K/V for GQA: queries are grouped per KV head,
[Hkv, G, hd] @ [Hkv, hd, S], so each cache byte is read once per step (a stronger peer, not a weaker one).
An MoE layer (Qwen3-MoE) runs its experts as grouped GEMMs (``torch._grouped_mm``, as torchtitan's MoE does): the
router's top k on the device, the token's row repeated once per chosen expert in ascending expert order, and group
boundaries that give every other expert zero rows, so each chosen expert's weights are read once, in place, and no
host sync is needed (CUDA graphs capture it); the k outputs are weighted and summed.

Routing record (``FusedDecoder.routing``): each MoE layer keeps a reference to the top k ids tensor of its last step
(``last_ids``), which adds no kernel to the step. Under a CUDA-graph capture that tensor is the graph's own output,
rewritten by every replay and kept alive by the reference; under torch.compile the attribute store is a side effect
Dynamo replays after the compiled graph, the ids one more output of it (k integers the top k computes anyway).

Numerics follow ``mimw.models.reference``: RMSNorm in fp32 cast back before the weight multiply, RoPE in fp32 from
``mimw.models.rope`` tables, softmax in fp32, matmuls in the weight dtype.

Cache size: ``cache_len`` >= context + 1 positions; the step at position C reads all ``cache_len`` (masked) rows, so
keep ``cache_len`` close to C + 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...models import rope
from ...models.moe import top_k
from ...models.spec import ModelSpec
from ..fused import BenchWeights
from ..inputs import DecodeInputs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, hd]; cos/sin [1, hd/2] fp32 (HF rotate_half pairing, as ``mimw.models.rope``)."""
    h = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :h], xf[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A one-GPU module's sums are whole already (tp_decoder.py joins a rank's partials instead)."""
    return t


class FusedLayer(nn.Module):
    def __init__(self, spec: ModelSpec, bw: BenchWeights, i: int, cache_len: int):
        super().__init__()
        lw = bw.weights.layers[i]
        self.spec = spec
        self.attn_norm, self.mlp_norm = _param(lw.attn_norm), _param(lw.mlp_norm)
        self.wqkv, self.bqkv = _param(bw.wqkv[i]), _param(bw.bqkv[i])
        self.q_norm, self.k_norm = _param(lw.q_norm), _param(lw.k_norm)
        self.wo, self.w_gate_up, self.w_down = _param(lw.wo), _param(bw.w_gate_up[i]), _param(lw.w_down)
        # an MoE layer's router [E, D] and stacked experts (gate, up [E, F, D]; down [E, D, F]); None when dense
        self.router, self.e_gate = _param(lw.router), _param(lw.e_gate)
        self.e_up, self.e_down = _param(lw.e_up), _param(lw.e_down)
        shape = (spec.num_kv_heads, cache_len, spec.head_dim)  # [Hkv, S, hd]
        self.register_buffer("k_cache", torch.zeros(shape, dtype=lw.wo.dtype, device=lw.wo.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=lw.wo.dtype, device=lw.wo.device))
        self.last_ids: torch.Tensor | None = None  # an MoE layer's last step's top k ids (module doc: routing record)
        self.join = _whole  # the projections' sums over every rank (tensor parallelism: tp_decoder.py)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [1, D] -> [1, D]; pos [1] long; cos/sin [1, hd/2] fp32; mask [S] bool (True = visible)."""
        s = self.spec
        hq, hkv, hd, eps = s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        h = _rms(x, self.attn_norm, eps)
        q, k, v = F.linear(h, self.wqkv, self.bqkv).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q, k, v = q.view(hq, hd), k.view(hkv, hd), v.view(hkv, hd)
        if self.q_norm is not None:
            q, k = _rms(q, self.q_norm, eps), _rms(k, self.k_norm, eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # in place at row pos: index_copy_ takes the row from a device tensor (no host sync, graph-capturable)
        self.k_cache.index_copy_(1, pos, k.unsqueeze(1))  # [Hkv, 1, hd]
        self.v_cache.index_copy_(1, pos, v.unsqueeze(1))
        qg = q.view(hkv, hq // hkv, hd)                  # [Hkv, G, hd]
        scores = torch.matmul(qg, self.k_cache.transpose(1, 2)).float() * hd ** -0.5  # [Hkv, G, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(p, self.v_cache).reshape(1, hq * hd)  # [Hkv, G, hd] -> [1, Q]
        x = x + self.join(F.linear(o, self.wo))
        h = _rms(x, self.mlp_norm, eps)
        if self.router is not None:
            return x + self._moe(h)
        gate, up = F.linear(h, self.w_gate_up).split([s.intermediate_size, s.intermediate_size], dim=-1)
        return x + self.join(F.linear(F.silu(gate) * up, self.w_down))

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        """h [1, D] -> the routed experts' weighted sum [1, D] (models.moe's routing and SwiGLU)."""
        w, ids = top_k(F.linear(h, self.router), self.spec)  # [1, k] fp32, [1, k]
        self.last_ids = ids
        experts, order = ids[0].sort()  # the k distinct experts ascending: row j is expert experts[j]'s
        k = experts.shape[0]
        rows = torch.zeros(self.e_gate.shape[0], dtype=torch.int32, device=h.device)  # rows an expert, then ends
        ones = torch.ones(k, dtype=torch.int32, device=h.device)
        ends = rows.index_add_(0, experts, ones).cumsum(0, dtype=torch.int32)
        hk = h.expand(k, -1).contiguous()  # [k, D]
        gate = torch._grouped_mm(hk, self.e_gate.transpose(1, 2), offs=ends)  # [k, F]: expert e's rows times W_e^T
        up = torch._grouped_mm(hk, self.e_up.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(F.silu(gate) * up, self.e_down.transpose(1, 2), offs=ends)  # [k, D]
        return (y * w[0, order].to(h.dtype).unsqueeze(-1)).sum(0, keepdim=True)


class FusedDecoder(nn.Module):
    """Batch-1 decode step: ``forward(token [1] long, pos [1] long) -> logits [1, V]`` (weight dtype)."""

    def __init__(self, bw: BenchWeights, cache_len: int):
        super().__init__()
        spec, w = bw.spec, bw.weights
        self.spec, self.cache_len = spec, cache_len
        self.embed = _param(w.embed)
        self.lm_head = self.embed if w.lm_head is w.embed else _param(w.lm_head)
        self.final_norm = _param(w.final_norm)
        self.layers = nn.ModuleList(FusedLayer(spec, bw, i, cache_len) for i in range(spec.num_layers))
        cos, sin = rope.cos_sin(spec, torch.arange(cache_len), device=w.device)  # [S, hd/2] fp32
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.register_buffer("positions", torch.arange(cache_len, device=w.device))
        self.gather = _whole  # the logits of every rank's vocabulary rows (tensor parallelism: tp_decoder.py)

    @torch.no_grad()
    def load_prefix(self, inputs: DecodeInputs) -> None:
        """Copy the context's K/V ([L, C, Hkv, hd]) into the cache buffers; rows >= C are zeroed."""
        c = inputs.context
        if c + 1 > self.cache_len:
            raise ValueError(f"context {c} needs cache_len >= {c + 1}, have {self.cache_len}")
        for i, layer in enumerate(self.layers):
            layer.k_cache.zero_(), layer.v_cache.zero_()
            layer.k_cache[:, :c] = inputs.k[i].transpose(0, 1)
            layer.v_cache[:, :c] = inputs.v[i].transpose(0, 1)

    def routing(self) -> list[torch.Tensor]:
        """The last step's top k ids [1, k] of every MoE layer, in layer order (module doc: routing record); a copy."""
        return [layer.last_ids.clone() for layer in self.layers if layer.router is not None]

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = F.embedding(token, self.embed)              # [1, D]
        cos, sin = self.cos[pos], self.sin[pos]         # [1, hd/2]
        mask = self.positions <= pos                    # [S]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.gather(F.linear(_rms(x, self.final_norm, self.spec.rms_norm_eps), self.lm_head))
