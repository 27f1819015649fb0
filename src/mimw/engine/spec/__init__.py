"""Speculative decoding: drafters propose tokens, one target step verifies them, the engine keeps what matches.

``drafter``      the ``Drafter`` protocol (propose / observe / finish) and its data (``DraftInput``, ``Draft``)
``ngram``        prompt lookup: the continuation of the latest earlier occurrence of the last n tokens
``suffix_trie``  a depth-bounded suffix trie with counts (insert, extend, remove, match, greedy walk)
``suffix``       SuffixDecoding: tries over the request's own tokens and its session's earlier requests
``draft_model``  a small model of the same tokenizer on its own paged cache, synced to the accepted tokens
``block``        a drafter that proposes a whole block in one forward pass (``BlockModel``: DFlash-style)
``verify``       the acceptance rule (greedy prefix match; speculative sampling), exact in distribution
``policy``       per-request draft length from acceptance and a step-cost model; batch back-off
``config``       ``SpecConfig`` and the ``--speculative/--draft-model/--spec-tokens`` options
``speculator``   what the engine calls each step: drafts for the planned chunks, verification, counters
"""
