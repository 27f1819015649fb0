"""Structured generation: grammars that constrain a request's output (JSON, JSON schema), on xgrammar.

xgrammar was chosen by measurement (``python -m mimw.bench.grammar``, bench/NOTES.md): on the default model's
49k vocabulary its mask + advance costs ~16 µs per token on this CPU, against ~21 µs for llguidance and ~155 µs
for outlines-core (whose schema compilation also takes ~250 ms against ~14 ms).

  ``GrammarCompiler``  one per (tokenizer, model vocabulary, stop ids); thread-safe; compiles schemas into
                       immutable ``Grammar`` objects (with a bounded cache). Invalid input: ``GrammarError``.
  ``Grammar``          a compiled grammar, shareable across requests and threads; ``matcher()`` starts one.
  ``GrammarMatcher``   one request's position in the grammar (engine thread only): ``allowed()`` is the packed
                       int32 bitmask of the tokens that may come next (what ``sampling.TokenContext`` carries),
                       ``accept(token)`` advances, ``finished`` says the output is complete.

Whitespace between JSON tokens is fixed (", " and ": ", no newlines): a small model can otherwise loop on
whitespace until max_tokens. When the document is complete only the stop tokens are allowed.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch

_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse, at most
_MAX_SCHEMA_BYTES = 256 << 10
_MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document (objects and arrays): ~30 levels of properties


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the client's mistake: a 400 in the server)."""


class GrammarMatcher:
    def __init__(self, matcher: Any, vocab_size: int):
        import xgrammar as xgr

        self._m = matcher
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]

    def allowed(self) -> torch.Tensor:
        """int32 [ceil(V / 32)]: bit (t % 32) of word t // 32 is set iff token t may come next (a fresh copy)."""
        self._m.fill_next_token_bitmask(self._mask)
        return self._mask[0].clone()

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it."""
        return bool(self._m.accept_token(int(token)))

    @property
    def finished(self) -> bool:
        """The output is complete (a stop token was accepted after a full document)."""
        return bool(self._m.is_terminated())


class Grammar:
    def __init__(self, compiled: Any, vocab_size: int, description: str):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.description = description

    def matcher(self) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(self._compiled), self.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


class GrammarCompiler:
    """Compiles JSON grammars for one tokenizer. ``hf_tokenizer`` is a Hugging Face tokenizer; ``vocab_size``
    the model's (the logits' width, which may exceed the tokenizer's); ``stop_token_ids`` end a document."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._c = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return self.json_schema({"type": "object"}, "json_object")

    def json_schema(self, schema: dict[str, Any] | bool, description: str = "json_schema") -> Grammar:
        """A JSON document valid against ``schema`` (draft 2020-12 subset that xgrammar supports)."""
        if schema is True or schema == {}:
            schema = {"type": ["object", "array", "string", "number", "integer", "boolean", "null"]}
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        depth = _depth(schema)
        if depth > _MAX_SCHEMA_DEPTH:  # compile time grows fast with nesting (seconds at ~200 levels)
            raise GrammarError(f"the JSON schema nests {depth} levels deep (limit {_MAX_SCHEMA_DEPTH})")
        text = json.dumps(schema)
        if len(text) > _MAX_SCHEMA_BYTES:
            raise GrammarError(f"the JSON schema is too large ({len(text)} bytes, limit {_MAX_SCHEMA_BYTES})")
        try:
            compiled = self._c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:  # xgrammar's InvalidJSONError included
            raise GrammarError(f"invalid JSON schema: {_clean(str(e))}") from None
        return Grammar(compiled, self.vocab_size, description)


def _clean(message: str) -> str:
    """xgrammar's C++ message without its '[hh:mm:ss] /path/file.cc:123: ' prefix."""
    return re.sub(r"\[[\d:]+\] \S+?:\d+: ", "", message).strip()


def _depth(doc: object) -> int:
    """Nesting depth of a JSON document (iterative: safe at any depth)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in x if isinstance(v, (dict, list)))
    return deepest
