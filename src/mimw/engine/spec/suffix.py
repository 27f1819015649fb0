"""SuffixDecoding: draft from suffix tries over the request's own tokens and over its session's earlier requests.

Agent loops re-emit what sits in their context (files, tool output, JSON) and repeat themselves across turns, so
the longest suffix of the current tokens that occurred before is a good predictor of what comes next, and how
often each continuation followed it says how far to trust it (Oliaro et al., "SuffixDecoding", 2024).

Per step and request:
  1. *own*: the request's trie (prompt + output so far, extended incrementally): the deepest suffix of its tokens
     that occurred earlier with a continuation;
  2. *session*: the trie of the session's finished requests (when the request has a ``session_id``): the deepest
     suffix of its tokens found there;
  2b. *global*: one trie of every finished request's output, whatever its session (SuffixDecoding's global tree:
     answers share idioms, code and boilerplate across users), matched the same way;
  3. from each match, walk the most frequent continuation while its empirical probability stays >= ``min_prob``,
     for at most min(k, ``spec_factor`` x match length + ``spec_offset``) tokens: a match seen once over a short
     context drafts little, a long or often-seen one drafts more;
  4. keep the candidate with the larger expected number of accepted tokens (the sum of the cumulative
     probabilities along it).

Bounded state: a request's trie lives until it finishes. A session keeps its finished requests' outputs (with
``lead_in`` prompt tokens before each) in two generations of ``session_tokens`` tokens each (``_Session``: the older
generation dropped whole when the newer fills, never a rebuild on the engine's thread); at most ``max_sessions``
sessions are kept, least recently used evicted. The global trie keeps ``global_tokens`` a generation the same way.
Drafts are only proposals, verified by the target, so sharing history across requests changes how many tokens a step
accepts, never what a request outputs.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from .config import SuffixConfig
from .drafter import DraftInput, TokenDrafter
from .suffix_trie import SuffixTrie


class _Session:
    """Bounded shared history in two generations of tries: sequences go into the newer one until it holds ``cap``
    tokens, then it becomes the older one and the previous older one is dropped whole. No trie is ever rebuilt, so
    a request's finish costs O(depth) a token however much history is kept (between ``cap`` and 2 x ``cap`` tokens
    once full); a lookup consults both generations."""

    def __init__(self, depth: int):
        self.depth = depth
        self.new, self.old = SuffixTrie(depth), None
        self.new_tokens = self.old_tokens = 0

    @property
    def tokens(self) -> int:
        return self.new_tokens + self.old_tokens

    @property
    def tries(self) -> tuple[SuffixTrie, ...]:
        return (self.new,) if self.old is None else (self.new, self.old)

    def add(self, seq: list[int], cap: int) -> None:
        if self.new_tokens and self.new_tokens + len(seq) > cap:
            self.old, self.old_tokens = self.new, self.new_tokens
            self.new, self.new_tokens = SuffixTrie(self.depth), 0
        self.new.add_sequence(seq)
        self.new_tokens += len(seq)


class _Own:
    """A request's own trie and the tokens already in it."""

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.sid = self.trie.add_sequence()

    @property
    def tokens(self) -> list[int]:
        return self.trie.seqs[self.sid]


class SuffixDrafter(TokenDrafter):
    def __init__(self, config: SuffixConfig = SuffixConfig()):
        self.cfg = config
        self._own: dict[str, _Own] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._global = _Session(config.depth) if config.global_tokens else None

    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        cfg = self.cfg
        own = self._sync(x)
        best, best_score = [], 0.0
        node, m = self._own_match(own)
        if m:
            cand, probs = own.trie.walk(node, self._limit(k, m), cfg.min_prob, tail=own.tokens)
            best, best_score = cand, sum(probs)
        session = self._sessions.get(x.session_id) if x.session_id is not None else None
        if session is not None:
            self._sessions.move_to_end(x.session_id)
        for shared in (session, self._global):
            for trie in shared.tries if shared is not None else ():
                node, m = trie.match(own.tokens, cfg.max_match)
                if m:
                    cand, probs = trie.walk(node, self._limit(k, m), cfg.min_prob)
                    if sum(probs) > best_score:
                        best, best_score = cand, sum(probs)
        return best

    def _limit(self, k: int, match_len: int) -> int:
        return max(0, min(k, int(self.cfg.spec_factor * match_len + self.cfg.spec_offset)))

    def _sync(self, x: DraftInput) -> _Own:
        own = self._own.get(x.request_id)
        toks = x.token_ids
        if own is not None:
            n = len(own.tokens)
            if len(toks) < n or list(toks[:n]) != own.tokens:
                own = None
        if own is None:
            own = self._own[x.request_id] = _Own(self.cfg.depth)
        own.trie.extend(own.sid, toks[len(own.tokens):])
        return own

    def _own_match(self, own: _Own) -> tuple[int, int]:
        """Deepest suffix of the request (<= max_match tokens) that occurred earlier with a continuation."""
        trie = own.trie
        for node in reversed(trie.active_nodes(own.sid)[:self.cfg.max_match + 1]):
            if node and trie.best[node] >= 0:
                return node, trie.node_depth[node]
        return 0, 0

    def finish(self, x: DraftInput) -> None:
        self._own.pop(x.request_id, None)
        history = list(x.token_ids[max(0, x.num_prompt_tokens - self.cfg.lead_in):])
        if self._global is not None:
            self._global.add(history, self.cfg.global_tokens)
        if x.session_id is None or self.cfg.max_sessions == 0:
            return
        session = self._sessions.get(x.session_id)
        if session is None:
            session = self._sessions[x.session_id] = _Session(self.cfg.depth)
            while len(self._sessions) > self.cfg.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(x.session_id)
        session.add(history, self.cfg.session_tokens)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def session_tokens(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return s.tokens if s else 0
