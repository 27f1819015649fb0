"""Incremental detokenisation and stop strings: token ids in, text deltas out, never half a character.

Byte-level BPE tokenizers split multi-byte UTF-8 characters across tokens; decoding a prefix then ends in U+FFFD.
``IncrementalDetokenizer`` decodes a short sliding window (a few tokens of context before the unread ones, so
leading-space rules of SentencePiece-style tokenizers see their left neighbour) and holds text back while the
window's decoding ends in U+FFFD. ``finish`` flushes whatever is left (a genuinely invalid byte sequence then
shows as U+FFFD, once). A window held back for more than ``_TAIL`` tokens that decode to something (a stream of
invalid bytes) is tested by decoding from its ``_TAIL``-th last such token only, and decoded whole once that tail no
longer ends in U+FFFD: a push costs a bounded decode however long the held text grows. Tokens that decode to
nothing (special tokens) are skipped when the tail is counted, so the tail always holds the last character's first
byte. The text before the unread ids is decoded once per window.

``StopMatcher`` turns the raw text stream into the text a client may see: it cuts at the first stop string (the
stop string itself is never emitted) and holds back any tail that could still grow into a stop string.
"""
from __future__ import annotations

from typing import Protocol, Sequence

_CONTEXT = 4  # prompt tokens kept as left context of the first output token
# held tokens that decode to something, past which the last ones alone tell whether the window still ends in an
# incomplete character: a UTF-8 character has at most 4 bytes, so its first byte lies in one of the last 4 of them
_TAIL = 8


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Invariant: the concatenation of every returned delta (plus ``finish``) equals decode(output ids), for
    tokenizers whose decoding of a window is a suffix-stable function of its tokens (byte-level BPE and friends)."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # first id whose text has not been returned
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), once computed
        # positions of the unread ids that decode to something alone, tracked once the window is held past _TAIL ids
        self._solid: list[int] | None = None

    def push(self, token_id: int) -> str:
        """Append one id; return the newly complete text (maybe empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        if not final and len(self.ids) - self.read_offset > _TAIL and self._tail_incomplete():
            return ""  # still an incomplete character at the end: the whole window would end in U+FFFD too
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._prefix_text = None
        self._solid = None
        return delta

    def _tail_incomplete(self) -> bool:
        """Whether the held window's text from its ``_TAIL``-th last non-empty token ends in U+FFFD (then so does
        the whole window's: UTF-8 resynchronises at the last character's first byte, which that tail holds)."""
        solid = self._solid
        if solid is None:
            solid = self._solid = [i for i in range(self.read_offset, len(self.ids) - 1)
                                   if self.tok.decode(self.ids[i:i + 1])]
        last = len(self.ids) - 1
        if self.tok.decode(self.ids[last:]):
            solid.append(last)
        if len(solid) < _TAIL:
            return False  # too few tokens with text to bound the tail: the caller decodes the whole window
        return self.tok.decode(self.ids[solid[-_TAIL]:]).endswith("\ufffd")


class StopMatcher:
    """Accumulates text; ``feed`` returns (text safe to emit, stopped)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""  # everything decoded so far (truncated at the stop string once stopped); kept with stops only
        self.sent = 0  # len of the prefix of ``text`` already emitted

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        if not self.stops:  # nothing to hold back or cut: the text passes through as it comes
            return delta, False
        self.text += delta
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._emit(len(self.text)), True
        safe = len(self.text) if final else len(self.text) - self._held_tail()
        return self._emit(safe), False

    def _held_tail(self) -> int:
        """Length of the longest suffix of ``text`` (not yet emitted) that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


class TextStream:
    """Token ids of one completion in, client-visible text out: ``IncrementalDetokenizer`` then ``StopMatcher``."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stops: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopMatcher(stops)

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text to emit, whether a stop string ended the completion: the stop and all after it are dropped)."""
        return self.stops.feed(self.detok.push(token_id))

    def finish(self) -> str:
        """Whatever was held back (a partial character, a tail that could have begun a stop string)."""
        return self.stops.feed(self.detok.finish(), final=True)[0]
