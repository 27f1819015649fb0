"""SpecConfig (and SuffixConfig): how the engine speculates, built at the edge (``--speculative``, ``--spec-tokens``).

The policy parameters describe the cost of a verify step, so that speculation backs off where it does not pay:

  num_tokens         K, the most tokens drafted for one request in one step (``--spec-tokens``).
  max_verify_tokens  the batch threshold: a step drafts only while the sampling requests' blocks (1 + draft each)
                     fit in this many tokens; a batch of that many decoding requests or more drafts nothing. Below
                     it a step reads the weights once whatever its token count (weight-bound); above it the
                     step's compute grows with every token and verifying guesses takes time from real work. 128
                     sits below the ridge point of a bf16 GEMM on an H100/H200 (~300 tokens) with room for
                     attention; lower it for a backend whose multi-token step is not weight-bound.
  verify_overhead    beta: the extra cost of a step that verifies a draft over a plain decode step, in decode steps
                     (0 when one kernel runs both; larger where verification takes a slower path).
  verify_token_cost  gamma: the cost of one more drafted token in the verify step, in decode steps (the reference
                     backend on the CPU measures ~0.06 with SmolLM2-135M in fp32; a weight-bound GPU step less).
  drafter_token_cost delta: the cost of drafting one token, in target decode steps: 0 for the model-free drafters;
                     for a draft model about its share of the target's weight bytes (``weight_ratio``), which
                     ``options.build_speculator`` fills in.
  probe_interval     a request whose acceptance made drafting not worth it drafts one token every this many
                     steps, so that its acceptance estimate can recover when its text turns repetitive.
"""
from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True)
class SuffixConfig:
    depth: int = 24  # trie depth: the longest context matched plus the statistics' reach beyond it
    max_match: int = 16  # longest suffix of the request matched (leaves depth - max_match for statistics)
    # stop drafting when the continuation's empirical probability drops below this: on the CPU a verified token
    # costs ~0.09 of a decode step, and replaying `bench spec`'s outputs offline (`mimw.bench.spec_replay`) drafts
    # fewer wasted tokens at 0.3 than at 0.1 for as many accepted ones
    min_prob: float = 0.3
    spec_factor: float = 2.0  # draft at most spec_factor x match length + spec_offset tokens
    spec_offset: float = 1.0
    session_tokens: int = 8192  # tokens of history a generation per session (two generations kept: suffix._Session)
    max_sessions: int = 64
    lead_in: int = 16  # prompt tokens kept before each finished request's output in its session trie
    global_tokens: int = 16384  # the same for the one history every request shares (0: none)

    def __post_init__(self) -> None:
        if not 1 <= self.max_match < self.depth:
            raise ValueError(f"need 1 <= max_match < depth, got {self.max_match}, {self.depth}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob}")
        if self.session_tokens < 1 or self.max_sessions < 0 or self.lead_in < 0 or self.global_tokens < 0:
            raise ValueError("session_tokens must be >= 1, max_sessions, lead_in and global_tokens >= 0")


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_tokens: int = 8
    draft_model: str | None = None  # --draft-model: what load_model loads (method "draft")
    max_verify_tokens: int = 128
    verify_overhead: float = 0.0
    verify_token_cost: float = 0.05
    drafter_token_cost: float = 0.0
    probe_interval: int = 16
    ngram_min: int = 1
    ngram_max: int = 4
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    draft_pages: int | None = None  # KV pages of the draft model's cache (None: as many as the target's)
    sample_drafts: bool = False  # draft model: sample drafts from q (standard rule) instead of its argmax

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"spec tokens must be in [1, 64], got {self.num_tokens}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model PATH (a model sharing the target's tokenizer)")
        if self.method != "draft" and self.draft_model:
            raise ValueError(f"--draft-model is only used with --speculative draft (got --speculative {self.method})")
        if self.max_verify_tokens < 2:
            raise ValueError(f"max_verify_tokens must be >= 2, got {self.max_verify_tokens}")
        if min(self.verify_overhead, self.verify_token_cost, self.drafter_token_cost) < 0:
            raise ValueError("verify_overhead, verify_token_cost and drafter_token_cost must be >= 0")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")
        if self.draft_pages is not None and self.draft_pages < 1:
            raise ValueError(f"draft_pages must be positive, got {self.draft_pages}")
