"""Sampling: per-request parameters and the pure function that turns one row of logits into a token id.

API (all the serving engine needs):
  ``SamplingParams``        frozen, validated at construction (``ValueError`` naming the field).
  ``make_generator(p)``     the request's own ``torch.Generator`` (CPU), seeded from ``p.seed``; ``None`` if greedy.
  ``sample(logits, p, g)``  logits [V] (any device, any float dtype) -> token id (int).
  ``sample_batch(...)``     the same for logits [B, V] with one (params, generator) per row.

Invariants:
  * temperature == 0 is greedy: ``argmax`` (lowest id on ties); top-k/top-p and the generator are not used.
  * Otherwise: logits / temperature -> keep the ``top_k`` most likely tokens (0 = all) -> keep the smallest
    most-likely-first prefix whose probability reaches ``top_p`` (the most likely token is always kept) ->
    renormalise -> draw one token with the request's generator.
  * Draws happen on the CPU in fp32, so a (seed, logits) pair gives the same token whatever device produced the
    logits, and concurrent requests never share random state: each owns its generator and advances it once per
    sampled token.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    temperature: >= 0; 0 means greedy.           top_p: in (0, 1]; 1 disables nucleus filtering.
    top_k: >= 0; 0 disables top-k filtering.      seed: None draws a fresh random seed per request.
    max_tokens: >= 1 new tokens at most.          stop: strings that end generation (not included in the output).
    stop_token_ids: extra token ids that end generation (the model's EOS ids are added by the engine unless
    ``ignore_eos``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists / a single string at the edge, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for i in self.stop_token_ids:
            if not _is_int(i) or i < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {i!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's private CPU generator (None when greedy). Seeded from ``params.seed``, else randomly."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed % (2**64))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> fp32 CPU probabilities [V] after temperature, top-k and top-p (zeros outside the kept set).

    Not meaningful for greedy params (temperature 0); ``sample`` never calls it then."""
    x = logits.detach().float().cpu() / params.temperature
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)  # ties keep the lower id first
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if 0 < params.top_k < sorted_p.numel():
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        # keep token j iff the probability mass strictly before it is < top_p (so the first token always stays)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep &= before < params.top_p
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs)
    out[order] = kept / kept.sum()
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V]. ``generator`` comes from ``make_generator(params)`` (ignored when greedy)."""
    if logits.dim() != 1:
        raise ValueError(f"sample expects logits of shape [vocab], got {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("non-greedy sampling needs the request's generator (make_generator(params))")
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> B token ids; row b uses ``params[b]`` and ``generators[b]``.

    Greedy rows are resolved with one batched argmax on the logits' device (one host sync for the batch)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"sample_batch: logits {tuple(logits.shape)} vs {len(params)} params, "
                         f"{len(generators)} generators")
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[b] if p.greedy else sample(logits[b], p, g)
            for b, (p, g) in enumerate(zip(params, generators))]
