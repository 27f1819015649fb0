"""Log-probabilities reported to clients (``logprobs`` / ``top_logprobs`` / prompt logprobs).

They are taken from the model's raw distribution - ``log_softmax`` of the logits as the model produced them,
before the grammar mask, ``logit_bias``, penalties, temperature or any filter - as vLLM reports them by default:
a client sees what the model thinks of each token, whatever the request's sampling settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of ``token_id`` at one position and the ``top`` most likely ids there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """logits [N, V] (any device) -> N ``TokenLogprob``: row n's logprob of ``token_ids[n]`` and its
    ``num_top[n]`` most likely ids. One batched log-softmax and top-k on the logits' device, one copy back."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids) or len(token_ids) != len(num_top):
        raise ValueError(f"logprobs_of: logits {tuple(logits.shape)} vs {len(token_ids)} ids, {len(num_top)} ks")
    if not len(token_ids):
        return []
    lp = torch.log_softmax(logits.detach().float(), dim=-1)
    ids = torch.tensor(list(token_ids), device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].cpu().tolist()
    k = min(max(num_top), lp.shape[1])
    if k > 0:
        top_lp, top_ids = torch.topk(lp, k, dim=-1)
        top_lp, top_ids = top_lp.cpu().tolist(), top_ids.cpu().tolist()
    out = []
    for n, t in enumerate(token_ids):
        top = tuple(zip(top_ids[n][:num_top[n]], top_lp[n][:num_top[n]])) if k > 0 else ()
        out.append(TokenLogprob(int(t), chosen[n], top))
    return out
