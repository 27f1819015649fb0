"""BatchedDecoder: the gpt-fast-style PyTorch decoder of ``torch_decoder.py`` for B sequences x T new tokens a step.

One module serves one step shape: decode batches (T = 1) and speculative-verify blocks (T = K). The recipe is
FusedDecoder's, widened:
  - fused ``wqkv`` and ``w_gate_up`` matmuls over all B x T tokens at once (the weights are read once a step);
  - per layer static KV caches [B, Hkv, S, hd] held as module buffers; each step writes its K/V rows in place at
    (b, pos[b, t]) with ``index_put_`` and device index tensors, so no host sync happens and one CUDA graph (or
    one compiled graph) serves every step of the shape;
  - attention over the whole static cache with the mask ``cache position <= pos[b, t]``: every sequence keeps
    its own context, and a block is causal inside itself because its own rows are written before the attention;
  - queries grouped per KV head ([B, Hkv, G*T, hd] @ [B, Hkv, hd, S]): K/V are never ``repeat_interleave``d, so
    each cache byte is read once a step.

Numerics follow ``mimw.models.reference`` (whose ``rms_norm`` and ``rope`` it calls): RMSNorm in fp32 cast back
before the weight multiply, RoPE in fp32, softmax in fp32, matmuls in the weight dtype. The weights are the prefill
path's ``FusedWeights`` (``MegakernelBackend.prefill.w``), wrapped as parameters without a copy.

``load_paged`` fills each sequence's rows [0, ctx_b) from mimw's paged cache, so that the module computes the same
step as a mimw backend over that cache and the two can be compared logit for logit.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...kv.pages import PagedKVCache
from ...models import rope
from ...models.reference import rms_norm
from ...models.spec import ModelSpec
from ...prefill.weights import FusedLayer as FusedLayerWeights
from ...prefill.weights import FusedWeights


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)  # shares t's storage


class BatchedLayer(nn.Module):
    def __init__(self, spec: ModelSpec, lw: FusedLayerWeights, batch: int, cache_len: int):
        super().__init__()
        self.spec = spec
        self.attn_norm, self.mlp_norm = _param(lw.attn_norm), _param(lw.mlp_norm)
        self.wqkv, self.bqkv = _param(lw.wqkv), _param(lw.bqkv)
        self.q_norm, self.k_norm = _param(lw.q_norm), _param(lw.k_norm)
        self.wo, self.w_gate_up, self.w_down = _param(lw.wo), _param(lw.w_gate_up), _param(lw.w_down)
        shape = (batch, spec.num_kv_heads, cache_len, spec.head_dim)  # [B, Hkv, S, hd]
        self.register_buffer("k_cache", torch.zeros(shape, dtype=lw.wo.dtype, device=lw.wo.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=lw.wo.dtype, device=lw.wo.device))

    def forward(self, x: torch.Tensor, slot: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, D] (N = B*T tokens, sequence-major); slot: (b [N, 1], kv head [1, Hkv], pos [N, 1]) cache indices;
        cos/sin [N, hd/2] fp32; mask [B, 1, 1, T, S] bool (True = visible) -> [N, D]."""
        s = self.spec
        hq, hkv, hd, eps = s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        b, g, t = mask.shape[0], hq // hkv, mask.shape[3]
        h = rms_norm(x, self.attn_norm, eps)
        q, k, v = F.linear(h, self.wqkv, self.bqkv).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q, k, v = q.view(-1, hq, hd), k.view(-1, hkv, hd), v.view(-1, hkv, hd)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        # rows (b, h, pos) <- k [N, Hkv, hd]: device indices, no host sync (graph-capturable), in place
        self.k_cache.index_put_(slot, k)
        self.v_cache.index_put_(slot, v)
        qg = q.view(b, t, hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, hd)  # [B, Hkv, G*T, hd]
        scores = torch.matmul(qg, self.k_cache.transpose(2, 3)).float() * hd ** -0.5   # [B, Hkv, G*T, S]
        scores = scores.view(b, hkv, g, t, -1).masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype).view(b, hkv, g * t, -1)
        o = torch.matmul(p, self.v_cache)                                              # [B, Hkv, G*T, hd]
        o = o.view(b, hkv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(b * t, hq * hd)    # head = kv head * G + g
        x = x + F.linear(o, self.wo)
        h = rms_norm(x, self.mlp_norm, eps)
        gate, up = F.linear(h, self.w_gate_up).split([s.intermediate_size, s.intermediate_size], dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down)


class BatchedDecoder(nn.Module):
    """One step of ``batch`` sequences x T tokens: ``forward(tokens [B, T] long, pos [B, T] long) -> logits
    [B, T, V]`` (weight dtype). Every position must be < ``cache_len`` (not checked on the device: no sync)."""

    def __init__(self, w: FusedWeights, batch: int, cache_len: int):
        super().__init__()
        spec = w.spec
        if spec.is_moe:
            raise ValueError(f"BatchedDecoder has no mixture-of-experts block ({spec.name})")
        if batch < 1 or cache_len < 1:
            raise ValueError(f"batch and cache_len must be positive, got {batch}, {cache_len}")
        self.spec, self.batch, self.cache_len = spec, batch, cache_len
        self.embed = _param(w.embed)
        self.lm_head = self.embed if w.tied else _param(w.lm_head)
        self.final_norm = _param(w.final_norm)
        self.layers = nn.ModuleList(BatchedLayer(spec, lw, batch, cache_len) for lw in w.layers)
        cos, sin = rope.cos_sin(spec, torch.arange(cache_len), device=w.device)  # [S, hd/2] fp32
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.register_buffer("positions", torch.arange(cache_len, device=w.device))
        self.register_buffer("kv_heads", torch.arange(spec.num_kv_heads, device=w.device)[None, :])  # [1, Hkv]
        self.register_buffer("sequences", torch.arange(batch, device=w.device))                     # [B]

    @torch.no_grad()
    def load_paged(self, cache: PagedKVCache, block_tables: Sequence[Sequence[int]],
                   contexts: Sequence[int]) -> None:
        """Sequence b's rows [0, contexts[b]) <- positions [0, contexts[b]) of ``cache`` through ``block_tables[b]``
        (``PagedKVCache.gather``: fp8 pages dequantised); every other row is zeroed."""
        if len(block_tables) != self.batch or len(contexts) != self.batch:
            raise ValueError(f"expected {self.batch} block tables and contexts, got {len(block_tables)}, "
                             f"{len(contexts)}")
        if max(contexts) >= self.cache_len:
            raise ValueError(f"context {max(contexts)} leaves no row for a new token in cache_len {self.cache_len}")
        for li, layer in enumerate(self.layers):
            layer.k_cache.zero_(), layer.v_cache.zero_()
            for b, (table, c) in enumerate(zip(block_tables, contexts)):
                if c == 0:
                    continue
                k, v = cache.gather(li, table, c)  # [c, Hkv, hd]
                layer.k_cache[b, :, :c] = k.transpose(0, 1)
                layer.v_cache[b, :, :c] = v.transpose(0, 1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = F.embedding(tokens.reshape(-1), self.embed)          # [N, D]
        p = pos.reshape(-1)
        cos, sin = self.cos[p], self.sin[p]                      # [N, hd/2]
        mask = (self.positions <= pos[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
        seq = self.sequences[:, None].expand(b, t).reshape(-1, 1)  # [N, 1]
        slot = (seq, self.kv_heads, p[:, None])                  # broadcast to [N, Hkv]
        for layer in self.layers:
            x = layer(x, slot, cos, sin, mask)
        x = rms_norm(x, self.final_norm, self.spec.rms_norm_eps)
        return F.linear(x, self.lm_head).view(b, t, -1)
