"""The speculative-decoding options of ``mimw serve`` and ``mimw generate``, and the speculator they build (this
module imports no torch until it builds one, so that the command line stays quick to start).

  --speculative ngram|suffix|draft   the drafter (off without it)
  --draft-model PATH|PRESET          the draft model of ``draft``: anything ``load_model`` loads, with the target's
                                     vocabulary and tokenizer
  --spec-tokens K                    most tokens drafted per request and step (default 8)
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .config import METHODS, SpecConfig

DEFAULT_SPEC_TOKENS = 8
_PROBE = "def main():\n    print('Hello, world!')  # speculative decoding"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (lossless: outputs are those of plain decoding)")
    g.add_argument("--speculative", default=None, choices=METHODS,
                   help="draft tokens and verify them in one step: ngram (prompt lookup), suffix (suffix trees over "
                        "the request and its session), draft (a draft model, --draft-model)")
    g.add_argument("--draft-model", default=None, metavar="PATH|PRESET",
                   help="draft model for --speculative draft (same tokenizer as the target)")
    g.add_argument("--spec-tokens", default=None, type=int, metavar="K",
                   help=f"most tokens drafted per request and step (default {DEFAULT_SPEC_TOKENS})")


def config_from_args(args: argparse.Namespace) -> SpecConfig | None:
    """The ``SpecConfig`` the flags ask for (None: no speculation); ``ValueError`` naming the flag otherwise."""
    if args.speculative is None:
        if args.draft_model is not None or args.spec_tokens is not None:
            raise ValueError("--draft-model and --spec-tokens need --speculative ngram|suffix|draft")
        return None
    k = DEFAULT_SPEC_TOKENS if args.spec_tokens is None else args.spec_tokens
    return SpecConfig(args.speculative, num_tokens=k, draft_model=args.draft_model)


def weight_ratio(draft: Any, target: Any) -> float:
    """Bytes of the draft model's weights over the target's (``ModelWeights``): a draft step's cost in target decode
    steps when both are weight-bound."""
    def nbytes(w: Any) -> int:
        seen, total = set(), 0
        for t in [w.embed, w.lm_head, w.final_norm] + [x for lw in w.layers for x in lw.tensors().values()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total
    return nbytes(draft) / nbytes(target)


def check_tokenizers(draft: Any, target: Any) -> None:
    """``LoadedModel``s: the draft must share the target's vocabulary (and tokenizer, when both have one)."""
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"--draft-model {draft.source}: vocabulary of {draft.spec.vocab_size} tokens, the target's "
                         f"has {target.spec.vocab_size}; the draft model must share the target's tokenizer")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.encode(_PROBE) != target.tokenizer.encode(_PROBE):
            raise ValueError(f"--draft-model {draft.source}: its tokenizer splits text differently from the "
                             "target's; the draft model must share the target's tokenizer")


def load_draft(cfg: SpecConfig, target: Any) -> Any:
    """The draft model of a "draft" config (a ``LoadedModel`` in the target's dtype, on its device), checked
    against the target's tokenizer; None for the model-free drafters."""
    if cfg.method != "draft":
        return None
    from ...models.checkpoint import load_model

    draft = load_model(cfg.draft_model, dtype=target.weights.dtype, device=target.weights.device, progress=False)
    check_tokenizers(draft, target)
    return draft


def build_speculator(cfg: SpecConfig, target: Any, page_size: int, num_pages: int, draft: Any = None) -> Any:
    """The speculator for ``cfg`` serving ``target`` (a ``LoadedModel``). For "draft", ``draft`` (from ``load_draft``)
    runs on the reference backend with its own cache of ``num_pages`` pages, and the policy counts its cost per
    drafted token as its share of the target's weight bytes."""
    from .speculator import Speculator, make_drafter

    if cfg.method != "draft":
        return Speculator(make_drafter(cfg), cfg)
    from ..backends.reference import ReferenceBackend

    if draft is None:
        draft = load_draft(cfg, target)
    cfg = dataclasses.replace(cfg, drafter_token_cost=weight_ratio(draft.weights, target.weights))
    return Speculator(make_drafter(cfg, ReferenceBackend(draft.weights), page_size, num_pages), cfg)
