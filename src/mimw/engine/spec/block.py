"""Block drafting: one forward pass of a drafter proposes all k tokens of a block at once (DFlash-style).

Autoregressive drafters pay k draft steps for k tokens; a block drafter (a small model trained to fill k masked
positions after the context in parallel) pays one. ``BlockModel`` is the interface point such a model implements;
``BlockDrafter`` adapts it to the ``Drafter`` protocol: one ``draft_block`` call per engine step for every request
that drafts, at the batch's largest k, each request's block cut to its own k.

Drafts are the block's per-position argmax (deterministic drafts: q is a point mass), or with ``sample=True`` and a
sampling request, draws from each position's filtered distribution, returned as ``Draft.probs`` for the standard
acceptance rule (the positions of one block are drawn independently, which is what such a model offers).

A trained block drafter conditions on the target's hidden states as well; the ``Backend`` does not expose them
yet, so ``BlockModel`` sees token ids only and a model that needs features gets them through its own
constructor.
"""
from __future__ import annotations

import secrets
from typing import Protocol, Sequence

import torch

from ..sampling import filtered_probs
from .drafter import NO_DRAFT, Draft, DraftInput


class BlockModel(Protocol):
    def draft_block(self, contexts: Sequence[Sequence[int]], k: int) -> torch.Tensor:
        """contexts (each a request's tokens so far) -> logits [len(contexts), k, V] for the next k positions."""
        ...


class BlockDrafter:
    def __init__(self, model: BlockModel, sample: bool = False):
        self.model = model
        self.sample = sample
        self._generators: dict[str, torch.Generator] = {}
        self.calls = 0  # forward passes of the block model (one per step that drafts)

    def propose(self, inputs: Sequence[DraftInput], ks: Sequence[int]) -> list[Draft]:
        live = [i for i, k in enumerate(ks) if k > 0]
        if not live:
            return [NO_DRAFT] * len(inputs)
        k_max = max(ks[i] for i in live)
        logits = self.model.draft_block([inputs[i].token_ids for i in live], k_max)
        self.calls += 1
        if logits.dim() != 3 or logits.shape[0] != len(live) or logits.shape[1] < k_max:
            raise ValueError(f"draft_block returned {tuple(logits.shape)}, expected [{len(live)}, {k_max}, vocab]")
        out = [NO_DRAFT] * len(inputs)
        for row, i in enumerate(live):
            x, k = inputs[i], ks[i]
            gen = self._generator(x)
            if gen is None:
                out[i] = Draft(tuple(torch.argmax(logits[row, :k], dim=-1).tolist()))
                continue
            q = torch.stack([filtered_probs(logits[row, j], x.params) for j in range(k)])
            toks = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
            out[i] = Draft(tuple(toks), q)
        return out

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def finish(self, x: DraftInput) -> None:
        self._generators.pop(x.request_id, None)

    def _generator(self, x: DraftInput) -> torch.Generator | None:
        if not self.sample or x.params.greedy:
            return None
        g = self._generators.get(x.request_id)
        if g is None:
            seed = x.params.seed if x.params.seed is not None else secrets.randbits(63)
            g = self._generators[x.request_id] = torch.Generator(device="cpu").manual_seed((seed ^ 0xB10C) % 2**64)
        return g
