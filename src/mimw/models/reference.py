"""The PyTorch reference decoder: the numerical oracle for every mimw backend.

Plain PyTorch on any device, over the paged KV cache (``mimw.kv.pages``). One ``forward`` call runs a *step*: a
list of sequence segments, each a run of consecutive new tokens of one sequence (a prefill chunk, one decode token,
or a speculative-verify block). Tokens attend causally to everything their sequence holds before them.

Numerics follow Hugging Face transformers' Llama/Qwen2/Qwen3/Qwen3-MoE modules (the MoE MLP: ``mimw.models.moe``):
RMSNorm in fp32 then cast back to the activation dtype before the weight multiply, RoPE tables in fp32, softmax in
fp32; matmuls in the weight dtype.
Attention runs one block of queries at a time (``attention``), so no [heads, T, S] score matrix is ever whole: the
default model's full 8k context prefills in a few hundred MB of scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..kv.pages import PagedKVCache
from . import rope
from .moe import Routing, moe_mlp
from .weights import ModelWeights


@dataclass(frozen=True)
class Segment:
    """``length`` new tokens of one sequence at positions start .. start+length-1, stored via ``block_table``.

    ``num_logits``: how many of the segment's last tokens get a row of logits when a step asks for each segment's
    last rows only (1 for a decode token or a prefill chunk; a speculative-verify block asks for all its tokens)."""

    block_table: tuple[int, ...]
    start: int
    length: int
    num_logits: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_logits <= self.length:
            raise ValueError(f"num_logits must be in [1, length={self.length}], got {self.num_logits}")


def logit_rows(segments: Sequence[Segment]) -> torch.Tensor:
    """Row indices (into the step's concatenated tokens) of every segment's last ``num_logits`` tokens."""
    rows, t0 = [], 0
    for s in segments:
        t0 += s.length
        rows.extend(range(t0 - s.num_logits, t0))
    return torch.tensor(rows, dtype=torch.long)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


# scores computed per query block at most: 2^25 fp32 elements (128 MB, plus as much for the softmax)
MAX_SCORE_ELEMENTS = 1 << 25


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              max_score_elements: int = MAX_SCORE_ELEMENTS) -> torch.Tensor:
    """q [T, Hq, hd] at positions q_pos [T]; k, v [S, Hkv, hd] for positions 0..S-1 -> [T, Hq, hd].

    Causal: query at position p sees keys 0..p. GQA: query head h reads KV head h // (Hq / Hkv).

    softmax(q k^T / sqrt(hd)) v in fp32, one block of queries at a time so that no [Hq, T, S] score matrix exists:
    a block holds at most ``max_score_elements`` scores and sees only the keys up to its last query's position.
    Each row's softmax is computed whole (no online rescaling), so the result is the plain formula's up to the
    summation order of the matmuls."""
    t, hq, hd = q.shape
    s, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    qf = q.float().view(t, hkv, g, hd).permute(1, 2, 0, 3)  # [Hkv, G, T, hd]
    kt = k.float().permute(1, 2, 0)[:, None]  # [Hkv, 1, hd, S]
    vf = v.float().transpose(0, 1)[:, None]  # [Hkv, 1, S, hd]
    out = torch.empty(hkv, g, t, hd, dtype=torch.float32, device=q.device)
    block = max(1, max_score_elements // (hq * max(s, 1)))
    for t0 in range(0, t, block):
        t1 = min(t, t0 + block)
        qp = q_pos[t0:t1]
        n = min(s, int(qp.max()) + 1)  # keys any query of the block can see
        sc = torch.matmul(qf[:, :, t0:t1], kt[..., :n]) * hd ** -0.5  # [Hkv, G, b, n]
        sc.masked_fill_(torch.arange(n, device=q.device)[None, :] > qp[:, None], float("-inf"))
        out[:, :, t0:t1] = torch.matmul(torch.softmax(sc, dim=-1), vf[:, :, :n])
    return out.permute(2, 0, 1, 3).reshape(t, hq, hd).to(q.dtype)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


class ReferenceDecoder:
    def __init__(self, weights: ModelWeights, linear: Callable[..., torch.Tensor] = F.linear,
                 join: Callable[[torch.Tensor], torch.Tensor] = _whole,
                 gather: Callable[[torch.Tensor], torch.Tensor] = _whole):
        """``linear(x, w, b=None)``: the dense layers' matmul (a backend may pass a faster one for some shapes,
        ``engine/backends/packed_linear.py``); ``F.linear`` by default. ``join`` / ``gather``: tensor parallelism
        (``weights`` one rank's shard: engine/backends/tensor_parallel.py): the o and down projections' partial
        sums summed over the ranks, and the rank's logits columns gathered into the whole vocabulary's."""
        self.w = weights
        self.spec = weights.spec
        self.linear = linear
        self.join, self.gather = join, gather

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache,
                last_only: bool = False, routings: list[Routing] | None = None,
                route: Callable[[int, Routing], Routing] | None = None) -> torch.Tensor:
        """tokens [T] (segments' tokens concatenated) -> logits [T, vocab] (fp32), or [sum(num_logits), vocab] for
        each segment's last ``num_logits`` tokens, in segment order, when ``last_only`` (the LM head then runs on
        those rows only). Writes K/V into ``cache``. ``routings``: a list that receives each MoE layer's routing of
        the T tokens, in layer order. ``route(layer, own routing) -> routing``: the routing an MoE layer runs
        instead of its router's own top k (``moe.moe_mlp``'s ``choose``)."""
        spec, w, linear = self.spec, self.w, self.linear
        if sum(s.length for s in segments) != tokens.numel():
            raise ValueError("segments' lengths must add up to the number of tokens")
        dev = w.device
        tokens = tokens.to(dev)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(dev)
        cos, sin = rope.cos_sin(spec, positions)
        x = w.embed[tokens]
        hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        for li, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, spec.rms_norm_eps)
            q = linear(h, lw.wq, lw.bq).view(-1, hq, hd)
            k = linear(h, lw.wk, lw.bk).view(-1, hkv, hd)
            v = linear(h, lw.wv, lw.bv).view(-1, hkv, hd)
            if spec.qk_norm:
                q = rms_norm(q, lw.q_norm, spec.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, spec.rms_norm_eps)
            q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
            outs, t0 = [], 0
            for s in segments:
                sl = slice(t0, t0 + s.length)
                cache.write(li, s.block_table, positions[sl], k[sl], v[sl])
                kc, vc = cache.gather(li, s.block_table, s.start + s.length)  # fp8: dequantised fp32
                outs.append(attention(q[sl], kc, vc, positions[sl]))  # attention computes in fp32
                t0 += s.length
            o = torch.cat(outs).reshape(-1, hq * hd)
            x = x + self.join(linear(o, lw.wo))
            h = rms_norm(x, lw.mlp_norm, spec.rms_norm_eps)
            if spec.is_moe_layer(li):
                choose = None if route is None else (lambda r, li=li: route(li, r))
                x = x + moe_mlp(h, lw, spec, routings, choose)
            else:
                x = x + self.join(linear(F.silu(linear(h, lw.w_gate)) * linear(h, lw.w_up), lw.w_down))
        if last_only:
            x = x[logit_rows(segments).to(dev)]
        x = rms_norm(x, w.final_norm, spec.rms_norm_eps)
        return self.gather(linear(x, w.lm_head).float())
