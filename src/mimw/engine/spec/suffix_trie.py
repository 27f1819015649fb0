"""SuffixTrie: every substring of length <= ``depth`` of a set of token sequences, with how often each occurred.

A node is a substring s (the root is the empty one); ``count[s]`` is the number of positions where s ends in the
inserted sequences, and ``best[s]`` the child s+t seen most often (the most recent on ties). Appending a token to a
sequence extends every suffix of length < depth that ends at its old end (the *active* nodes) by one token, so a
token costs O(depth) and the trie holds at most depth x (tokens inserted) nodes.

What SuffixDecoding needs from it:
  * ``match(context)``: the deepest node that is a suffix of ``context`` (the longest context seen before);
  * ``walk(node, ...)``: from there, the most frequent next token again and again while the empirical probability
    of the whole continuation, prod count(child) / count(parent), stays >= ``min_prob``. Past ``depth`` the
    continuation is read from the latest occurrence of the last node in its sequence (statistics end there; the
    copy is what prompt lookup would propose).

Nodes live in flat lists and one dict (``node * _SHIFT + token -> child``), about 150 bytes a node, instead of one
Python object per node. Counts only grow; a bounded user (``SuffixDrafter``'s sessions) rebuilds a trie from the
sequences it keeps instead of removing any.
"""
from __future__ import annotations

from typing import Sequence

_SHIFT = 1 << 24  # > any vocabulary size


class SuffixTrie:
    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix trie depth must be >= 2, got {depth}")
        self.depth = depth
        self._child: dict[int, int] = {}
        self.count: list[int] = [0]
        self.best: list[int] = [-1]  # most frequent child, -1 for a leaf
        self.followed: list[int] = [0]  # occurrences followed by a token (the sum of the children's counts)
        self.node_depth: list[int] = [0]
        self.seq_of: list[int] = [-1]  # latest occurrence of each node: sequence id and end position (exclusive)
        self.end_of: list[int] = [0]
        self.seqs: list[list[int]] = []
        self._active: list[list[int]] = []  # per sequence: nodes of its suffixes of length 0 .. depth-1

    @property
    def num_nodes(self) -> int:
        return len(self.count)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    # --- building ---------------------------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int] = ()) -> int:
        """Start a new sequence (optionally with tokens); returns its id for ``extend``."""
        self.seqs.append([])
        self._active.append([0])
        sid = len(self.seqs) - 1
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        seq, active = self.seqs[sid], self._active[sid]
        for t in tokens:
            t = int(t)
            seq.append(t)
            end = len(seq)
            nxt = [0]
            for a in active:
                c = self._get_or_add(a, t)
                self.count[c] += 1
                self.followed[a] += 1
                self.seq_of[c], self.end_of[c] = sid, end
                b = self.best[a]
                if b < 0 or self.count[c] >= self.count[b]:
                    self.best[a] = c
                if self.node_depth[c] < self.depth:
                    nxt.append(c)
            self.count[0] += 1
            active[:] = nxt

    def _get_or_add(self, parent: int, token: int) -> int:
        key = parent * _SHIFT + token
        c = self._child.get(key)
        if c is None:
            c = self._child[key] = len(self.count)
            self.count.append(0)
            self.best.append(-1)
            self.followed.append(0)
            self.node_depth.append(self.node_depth[parent] + 1)
            self.seq_of.append(-1)
            self.end_of.append(0)
        return c

    # --- queries ------------------------------------------------------------------------------------------------
    def child(self, node: int, token: int) -> int | None:
        return self._child.get(node * _SHIFT + token)

    def find(self, tokens: Sequence[int]) -> int | None:
        node = 0
        for t in tokens:
            node = self._child.get(node * _SHIFT + int(t))
            if node is None:
                return None
        return node

    def token_of(self, node: int) -> int:
        """The last token of a node's substring (read from its latest occurrence)."""
        return self.seqs[self.seq_of[node]][self.end_of[node] - 1]

    def match(self, context: Sequence[int], max_len: int | None = None) -> tuple[int, int]:
        """(node, length) of the longest suffix of ``context`` (at most ``max_len`` tokens) present in the trie that
        has a continuation; (0, 0) when none has. Binary search: if a suffix is present, so are its suffixes."""
        hi = min(len(context), self.depth - 1, max_len if max_len is not None else self.depth)
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.find(context[len(context) - mid:]) is not None:
                lo = mid
            else:
                hi = mid - 1
        # the longest present suffix may be a leaf (seen only at a sequence's end): shorten until it continues
        for m in range(lo, 0, -1):
            node = self.find(context[len(context) - m:])
            if node is not None and self.best[node] >= 0:
                return node, m
        return 0, 0

    def active_nodes(self, sid: int) -> list[int]:
        """Nodes of the suffixes (lengths 0 .. depth-1) ending at the end of sequence ``sid``, shortest first."""
        return self._active[sid]

    def walk(self, node: int, max_tokens: int, min_prob: float,
             tail: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
        """The most frequent continuation of ``node``: tokens and the cumulative probability after each.

        Stops at ``max_tokens``, when the cumulative probability would drop below ``min_prob``, or at a leaf. At
        the depth limit it copies on from the node's latest occurrence; ``tail`` (the requester's own tokens, when
        ``node``'s sequence is the requester's) lets that copy run past the sequence's end into the draft itself."""
        out: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(out) < max_tokens:
            c = self.best[node]
            if c < 0:
                break
            p = prob * self.count[c] / self.followed[node]
            if p < min_prob:
                break
            prob = p
            out.append(self.token_of(c))
            probs.append(prob)
            node = c
            if self.node_depth[node] >= self.depth:
                out += self._copy_on(node, max_tokens - len(out), tail, out)
                probs += [prob] * (len(out) - len(probs))
                break
        return out, probs

    def _copy_on(self, node: int, n: int, tail: Sequence[int] | None, drafted: list[int]) -> list[int]:
        """Up to n tokens that followed ``node``'s latest occurrence; when that sequence is ``tail`` (the
        requester's own), reading past its end continues into ``drafted`` + the copy (an overlapping copy)."""
        seq, start = self.seqs[self.seq_of[node]], self.end_of[node]
        own = tail is not None and seq is tail
        n0, base = len(seq), len(drafted)
        out: list[int] = []
        for i in range(n):
            j = start + i
            if j < n0:
                out.append(seq[j])
            elif own and j - n0 < base + i:
                k = j - n0
                out.append(drafted[k] if k < base else out[k - base])
            else:
                break
        return out
