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

``generate_with_engine`` keeps the same protocol but runs the request through the serving ``Engine`` (batch of
one), which is how ``mimw generate --speculative ...`` speculates; its outputs are the same tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

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
             tokenizer: Tokenizer | None = None, page_size: int = 16,
             kv_dtype: torch.dtype | None = None) -> Iterator[Step]:
    """Stream the completion of ``prompt_ids`` (see the module docstring for the protocol). The KV cache holds
    ``kv_dtype`` (``mimw.kv.pages``; default the weights' dtype)."""
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
    layout = KVLayout.for_spec(spec, page_size, -(-total // page_size), dtype=kv_dtype or weights.dtype)
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


def generate_with_engine(model: Any, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: Tokenizer,
                         spec_config: Any = None, page_size: int = 16,
                         on_stats: Callable[[Any], None] | None = None,
                         kv_dtype: torch.dtype | None = None) -> Iterator[Step]:
    """``generate``'s protocol, served by an ``Engine`` over ``model`` (a ``LoadedModel``) with the speculator of
    ``spec_config`` (a ``SpecConfig``; None: plain decoding). ``on_stats`` gets the engine's final ``EngineStats``;
    the engine's KV cache holds ``kv_dtype`` (default the weights' dtype)."""
    from .engine.backends.reference import ReferenceBackend
    from .engine.engine import Engine, EngineConfig
    from .engine.spec.options import build_speculator

    prompt = [int(t) for t in prompt_ids]
    limit = model.spec.max_position_embeddings
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {limit}")
    max_tokens = min(params.max_tokens, limit - len(prompt))
    k = spec_config.num_tokens if spec_config is not None else 0
    num_pages = -(-(len(prompt) + max_tokens + k) // page_size) + 1
    cfg = EngineConfig(num_pages=num_pages, page_size=page_size, max_batch=1, max_step_tokens=max(512, page_size),
                       enable_prefix_cache=False)
    speculator = build_speculator(spec_config, model, page_size, num_pages) if spec_config is not None else None
    backend = ReferenceBackend(model.weights, kv_dtype=kv_dtype, packed_linear=speculator is not None)
    engine = Engine(backend, tokenizer, cfg, tokenizer.eos_token_ids, speculator=speculator)
    events: list = []
    req = engine.add_request("generate", prompt, dataclasses.replace(params, max_tokens=max_tokens),
                             on_output=events.append)
    while engine.has_work():
        engine.step()
        for ev in events:
            if ev.error:
                raise RuntimeError(ev.error)
            toks = list(ev.token_ids)
            if ev.finish_reason == "stop" and toks and toks[-1] in req.stop_token_ids:
                toks.pop()  # a stop token is not part of the completion
            for i, t in enumerate(toks):
                yield Step(t, ev.text if i == len(toks) - 1 and not ev.finished else "")
            if ev.finished:
                reason = ev.finish_reason
                if reason == "length" and ev.completion_tokens < params.max_tokens:
                    reason = "context"
                yield Step(None, ev.text, reason)
        events.clear()
    if on_stats is not None:
        on_stats(engine.stats())
