"""The tokenizer as the server uses it from many threads, with no lock shared across requests.

A Hugging Face fast tokenizer is one Rust object: transformers flips settings on it (a mutable borrow) inside
``encode``, so two threads using one object fail with "Already borrowed", and one lock around it makes every request
wait for the longest tokenisation in flight - the engine thread's detokenisation included, which stalls every
stream. Instead, each user gets its own copy:

  * ``TokenizerPool.encode`` / ``apply_chat_template`` / ``token_bytes`` / ``borrow(fn)`` (request handlers, in
    worker threads) borrow one of a few copies for the call; a long prompt holds one copy, never the others, and the Rust side releases the GIL
    while it tokenizes, so the event loop and the engine thread keep running;
  * ``for_engine()`` is the engine thread's own copy, for incremental detokenisation (``decode`` here borrows a
    pool copy, for any other thread).

``prompt_byte_limit(max_tokens)`` is the size in UTF-8 bytes past which a prompt text certainly has more than
``max_tokens`` tokens, so that the server refuses it before tokenizing (``None`` when no such bound can be proved
for this tokenizer's pipeline, see ``_max_bytes_per_token``).
"""
from __future__ import annotations

import copy
import json
import queue
from typing import Any, Callable, Sequence

# Normalizers that may shrink a text, and by how much at most: Unicode composition turns up to three code points
# (Hangul jamo L+V+T, 9 bytes) into one syllable (3 bytes); compatibility mappings turn a 3-byte character into
# a 1-byte one (fullwidth "Ａ" -> "A"); lowercasing shrinks a few characters by a byte ("ẞ" -> "ß").
_NORMALIZER_SHRINK = {"NFC": 3.0, "NFKC": 3.0, "NFKD": 3.0, "NFD": 1.0, "Lowercase": 1.5, "Prepend": 1.0}
# Pre-tokenizers that keep every byte of the text (split it, never drop it)
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts")


class TokenizerPool:
    def __init__(self, tok: Any, copies: int = 4):
        self._proto = tok
        self._free: queue.Queue = queue.Queue()
        for _ in range(copies):
            self._free.put(copy.deepcopy(tok))
        self.eos_token_ids = tuple(getattr(tok, "eos_token_ids", ()))
        self.has_chat_template = bool(getattr(tok, "has_chat_template", False))
        self.chat_template: str = getattr(tok, "chat_template", "") if self.has_chat_template else ""
        self.max_bytes_per_token = _max_bytes_per_token(tok)

    def for_engine(self) -> "EngineDecoder":
        """A copy for the engine thread's detokenisation alone."""
        return EngineDecoder(copy.deepcopy(self._proto))

    def borrow(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(tokenizer)`` on a copy that no other thread uses meanwhile (e.g. building a grammar compiler)."""
        tok = self._free.get()
        try:
            return fn(tok)
        finally:
            self._free.put(tok)

    def encode(self, text: str) -> list[int]:
        return self.borrow(lambda t: t.encode(text))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return self.borrow(lambda t: t.apply_chat_template(messages, tools=tools))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return self.borrow(lambda t: t.token_bytes(ids))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens (chat markup never reaches a client)."""
        return self.borrow(lambda t: t.decode(ids, skip_special_tokens=True))

    def prompt_byte_limit(self, max_tokens: int) -> int | None:
        """UTF-8 bytes past which a text certainly encodes to more than ``max_tokens`` tokens (None: unknown)."""
        if self.max_bytes_per_token is None:
            return None
        return int(max_tokens * self.max_bytes_per_token) + 1


class EngineDecoder:
    """One tokenizer copy that only the engine thread uses: ``decode`` skips special tokens."""

    def __init__(self, tok: Any):
        self.tok = tok

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _max_bytes_per_token(tok: Any) -> float | None:
    """An upper bound on the input bytes one token can cover, or None where the pipeline can drop or fuse input
    (a normalizer that strips characters, a pre-tokenizer that removes them, fused unknown tokens), since then no
    number of bytes guarantees a number of tokens."""
    if hasattr(tok, "bytes_per_token"):  # e.g. the UTF-8 byte fallback tokenizer: one byte per token
        return float(tok.bytes_per_token)
    backend = getattr(getattr(tok, "hf", None), "backend_tokenizer", None)
    if backend is None:
        return None
    cfg = json.loads(backend.to_str())
    shrink = _shrink(cfg.get("normalizer"))
    if shrink is None or not _keeps_text(cfg.get("pre_tokenizer")):
        return None
    model = cfg.get("model") or {}
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    vocab = model.get("vocab") or {}
    # Vocabulary strings are at least as long in UTF-8 as the text they stand for (byte-level BPE writes each byte
    # as a 1-2 byte character; SentencePiece writes a space as the 3-byte "▁"); added tokens match their text.
    words = list(vocab if isinstance(vocab, dict) else (w for w, _ in vocab))
    words += [t.get("content", "") for t in cfg.get("added_tokens") or []]
    if not words:
        return None
    return shrink * max(len(w.encode("utf-8", "surrogatepass")) for w in words)


def _shrink(normalizer: dict | None) -> float | None:
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1.0
        for n in normalizer.get("normalizers") or []:
            s = _shrink(n)
            if s is None:
                return None
            total *= s
        return total
    if kind == "Replace":  # shrinks unless the replacement is at least as long as the pattern
        pattern = normalizer.get("pattern") or {}
        if "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"]):
            return 1.0
        return None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and str(pre.get("behavior", "")).lower() != "removed"
