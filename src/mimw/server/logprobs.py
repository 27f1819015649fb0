"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprob`` entries (raw log-softmax of the model).

Chat (``logprobs: true``, ``top_logprobs: 0..20``):
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...],
     "refusal": null}
Completions (``logprobs: 0..5``; the sampled token is always among ``top_logprobs``, so up to logprobs + 1):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}
with ``echo``, the prompt's tokens come first, the first of them without a logprob (null).

A token's text is its bytes decoded as UTF-8; a token that holds part of a character is written ``bytes:\\xNN``
(OpenAI's convention) and its ``bytes`` give the exact value.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..engine.logprobs import TokenLogprob


class TokenTable:
    """Every token id's (text, bytes), built once from the tokenizer (call ``build`` off the event loop)."""

    def __init__(self, token_bytes: Callable[[Sequence[int]], list[bytes]], vocab_size: int):
        self._token_bytes, self.vocab_size = token_bytes, vocab_size
        self._texts: list[str] | None = None
        self._bytes: list[list[int]] = []

    @property
    def ready(self) -> bool:
        return self._texts is not None

    def build(self) -> None:
        if self._texts is not None:
            return
        raw = self._token_bytes(range(self.vocab_size))
        texts = []
        for b in raw:
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append("bytes:" + "".join(f"\\x{x:02x}" for x in b))
        self._bytes = [list(b) for b in raw]
        self._texts = texts

    def text(self, token_id: int) -> str:
        assert self._texts is not None, "TokenTable.build() first"
        return self._texts[token_id] if 0 <= token_id < len(self._texts) else ""

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else []


def chat_logprobs(table: TokenTable, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": table.text(t), "logprob": lp, "bytes": table.bytes(t)}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """Builds the completions shape for one choice, chunk by chunk (``text_offset`` runs across chunks)."""

    def __init__(self, table: TokenTable):
        self.table = table
        self.offset = 0

    def build(self, entries: Sequence[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        """entries: (token id, its logprob entry or None for a prompt's first token)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e in entries:
            text = self.table.text(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(e.logprob)
            top = {self.table.text(i): lp for i, lp in e.top}
            top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
        return out
