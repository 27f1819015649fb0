"""Single-request generation over the reference decoder: prefill the prompt, then decode one token per step.

The simplest complete use of the pieces (``ReferenceDecoder``, ``PagedKVCache``, ``sampling``, ``TextStream``):
no batching and no scheduler; the serving engine does those. Used by ``mimw generate`` and as an end-to-end
oracle in tests.

``generate`` yields one ``Step`` per sampled token and then a final ``Step`` with ``token_id=None`` and the
``finish_reason``:
  "stop"    an EOS / stop token id was sampled (not emitted) or a stop string appeared (text cut before it)
  "length"  ``max_tokens`` were generated
  "context" the model's ``max_position_embeddings`` was reached
Concatenating every ``Step.text`` gives the completion text; no delta splits a multi-byte character, and no text
that could still become the start of a stop string is emitted early.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .engine.sampling import SamplingParams, make_generator, sample
from .kv.pages import KVLayout, PagedKVCache
from .models.reference import ReferenceDecoder, Segment
from .engine.detokenize import TextStream
from .models.tokenizer import Tokenizer
from .models.weights import ModelWeights


@dataclass(frozen=True)
class Step:
    token_id: int | None  # None only on the final step
    text: str  # text delta ("" when there is no tokenizer or a character is still partial)
    finish_reason: str | None = None  # set only on the final step


def generate(weights: ModelWeights, prompt_ids: Sequence[int], params: SamplingParams,
             tokenizer: Tokenizer | None = None, page_size: int = 16) -> Iterator[Step]:
    """Stream the completion of ``prompt_ids`` (see the module docstring for the protocol)."""
    spec = weights.spec
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {spec.vocab_size})")
    limit = spec.max_position_embeddings
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {limit}")
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= set(spec.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (this model has none)")

    total = min(len(prompt) + params.max_tokens, limit)
    layout = KVLayout.for_spec(spec, page_size, -(-total // page_size), dtype=weights.dtype)
    cache = PagedKVCache(layout, device=weights.device)
    table = tuple(range(layout.num_pages))
    decoder = ReferenceDecoder(weights)
    gen = make_generator(params)
    text = TextStream(tokenizer, prompt, params.stop) if tokenizer else None

    logits = decoder.forward(torch.tensor(prompt), [Segment(table, 0, len(prompt))], cache, last_only=True)[0]
    pos, produced = len(prompt), 0
    while True:
        tok = sample(logits, params, gen)
        if tok in stop_ids:
            yield Step(None, text.finish() if text else "", "stop")
            return
        produced += 1
        delta, hit = text.push(tok) if text else ("", False)
        if hit:
            yield Step(tok, delta, None)
            yield Step(None, "", "stop")
            return
        yield Step(tok, delta)
        if produced >= params.max_tokens or pos + 1 > limit - 1:
            reason = "length" if produced >= params.max_tokens else "context"
            yield Step(None, text.finish() if text else "", reason)
            return
        logits = decoder.forward(torch.tensor([tok]), [Segment(table, pos, 1)], cache)[-1]
        pos += 1
