"""Engine: the synchronous core of serving - submit requests, run steps, emit ``RequestOutput`` events.

One ``step`` = schedule (``Scheduler``) -> drafts for the sampling chunks (with a ``Speculator``) -> one backend
call over the planned segments -> commit the K/V -> sample the requests whose chunk reached their last token, or
verify their drafts -> stop checks and incremental detokenisation, token by token -> events (one per request and
step; a verified draft gives several tokens in one event). Everything here runs on one thread (``EngineLoop``
provides it); it is not thread-safe.

Overlap (``overlap.py``, docs/engine.md; ``EngineConfig.overlap``, on by default): the requests that need nothing
from the host between two tokens sample on the device, and the step returns before reading their tokens; the next
step launches first, its inputs taken from the device, and then reads them and does their per-token work. A step
holding a request that needs the host (``overlap.needs_host``), drafts or prompt logprobs is read at once.

Sessions (``sessions.SessionTable``): a request may name a session; when it finishes, the session retains its
pages (pinned in the ``Retention`` that orders every tier's evictions) until the session's TTL runs out or it is
closed. With ``host_kv_bytes``, a host tier (``mimw.kv.host_tier``) keeps pages the device cache evicts; ``step``
fences the compute on copies of reused pages first and backs up the pages the next evictions will take after.

Request validation lives here too, so that every front end (server, CLI, benchmarks) rejects the same inputs:
``check_lengths`` raises ``RequestError`` naming the offending parameter.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..kv.allocator import PageAllocator
from ..kv.host_tier import HostKVTier
from ..kv.prefix import PrefixCache
from ..kv.retention import POLICIES, Retention
from ..kv.transfer import PageCopier
from ..models.reference import Segment
from ..pinned import PinnedRing
from ..profiling import phase
from . import chunking
from .argmax import DeviceArgmax
from .backends.base import Backend
from .detokenize import Decoder, TextStream
from .logprobs import TokenLogprob, logprobs_of
from .request import Request, RequestOutput, RequestTimes
from .overlap import InFlight, needs_host, step_tokens
from .sampling import SamplingParams, TokenContext, draw_uniforms, make_generator, on_device, sample_batch, sample_ids
from .scheduler import Scheduler, SchedulerConfig
from .spec.drafter import NO_DRAFT
from .spec.speculator import SpecStats, Speculator
from .sessions import MAX_SESSION_ID_CHARS, SessionTable


class RequestError(ValueError):
    """A request the engine cannot serve as asked; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class EngineConfig:
    """num_pages x page_size tokens of KV in total; a request may use up to max_model_len of them."""

    num_pages: int = 256
    page_size: int = 16
    max_batch: int = 32
    max_step_tokens: int = 512
    max_model_len: int | None = None  # None: min(model's max positions, num_pages * page_size)
    enable_prefix_cache: bool = True
    max_prefill_step_tokens: int = 0  # tokens of a step with no decoding request (0: max_step_tokens)
    attention_cost_tokens: int | None = None  # chunk cost model's R (engine/chunking.py); None: from the model
    session_ttl_s: float = 300.0  # a session's pages are retained this long after its last request
    max_sessions: int = 4096  # live sessions at most (the least recently used idle one is closed past it)
    kv_eviction: str = "session"  # "session": live sessions' pages are evicted last; "lru": plain LRU
    host_kv_bytes: int = 0  # host-memory KV tier (0: none); needs the prefix cache
    overlap: bool = True  # launch step N+1 before reading step N's tokens (engine/overlap.py)

    def __post_init__(self) -> None:
        if self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_eviction not in POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(POLICIES)}, got {self.kv_eviction!r}")
        if self.session_ttl_s < 0 or self.max_sessions <= 0 or self.host_kv_bytes < 0:
            raise ValueError("session_ttl_s and host_kv_bytes must be >= 0 and max_sessions positive")
        if self.host_kv_bytes and not self.enable_prefix_cache:
            raise ValueError("the host KV tier keeps prefix-cache pages: it needs the prefix cache enabled")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        self.scheduler_config()  # validates the rest

    def scheduler_config(self, attention_cost_tokens: int = 0) -> SchedulerConfig:
        """``attention_cost_tokens`` is used where this config leaves it to the model (None)."""
        r = attention_cost_tokens if self.attention_cost_tokens is None else self.attention_cost_tokens
        return SchedulerConfig(self.page_size, self.max_batch, self.max_step_tokens, self.max_prefill_step_tokens, r)


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    pages_total: int
    pages_in_use: int
    pages_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed (cached ones included)
    generation_tokens: int = 0  # tokens sampled, counted when sampled (aborted requests' included)
    spec: SpecStats | None = None  # speculative decoding's counters (None without a speculator)
    restoring: int = 0  # admitted requests waiting for pages from the host tier
    prefix_host_hit_tokens: int = 0  # of prefix_hit_tokens, those restored from the host tier
    host_pages_total: int = 0
    host_pages_used: int = 0
    kv_bytes_to_host: int = 0
    kv_bytes_to_device: int = 0
    sessions_live: int = 0
    step_tokens: int = 0  # tokens the steps ran (prompt chunks, decode tokens, drafts), summed over steps


class Engine:
    def __init__(self, backend: Backend, tokenizer: Decoder, config: EngineConfig,
                 eos_token_ids: Sequence[int] = (), speculator: Speculator | None = None,
                 host_copier: PageCopier | None = None):
        self.backend = backend
        self.speculator = speculator
        if speculator is not None:  # the draft-length policy prices drafts at this backend's measured step times
            speculator.costs = backend.step_costs
        self.tokenizer = tokenizer
        self.config = config
        spec = backend.spec
        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings,
                                 spec.max_position_embeddings, config.num_pages * config.page_size)
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(spec.eos_token_ids)
        self.cache = backend.make_cache(config.page_size, config.num_pages)
        self.retention = Retention(config.kv_eviction)
        self.sessions = SessionTable(self.retention, config.session_ttl_s, config.max_sessions)
        self.prefix = PrefixCache(config.page_size, self.retention) if config.enable_prefix_cache else None
        self.host = None
        if config.host_kv_bytes and self.prefix is not None:
            self.host = HostKVTier.for_bytes(self.cache, config.host_kv_bytes, self.retention, host_copier)
            self.prefix.on_evict = self.host.on_device_evict
        # pages the next step may take: keep this many free or backed up on the host
        self._backup_window = -(-config.max_step_tokens // config.page_size) + config.max_batch
        self.allocator = PageAllocator(config.num_pages, self.prefix)
        self.scheduler = Scheduler(config.scheduler_config(chunking.attention_cost_tokens(spec)), self.allocator,
                                   self.prefix, self.host)
        self._session_of: dict[str, str] = {}  # request id -> its session, while the session retains for it
        self._close_after: dict[str, str] = {}  # request id -> the session to close when it finishes
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, TextStream] = {}
        self._preemptions = 0
        self._steps = 0
        self._step_tokens = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._overlap = config.overlap and speculator is None  # drafts are proposed from the tokens the host holds
        self._inflight: InFlight | None = None  # the latest step's tokens, sampled on the device, not yet read
        self._ids_ring = PinnedRing(config.max_batch, backend.device)  # pinned buffers for those tokens' copies
        self._argmax = DeviceArgmax()  # greedy rows' picks in one launch (its tickets: this engine's stream)
        if backend.device.type == "cuda":
            self._argmax.warm(backend.spec.vocab_size, backend.device)  # its compile, not a first request's
        self._held: list[RequestOutput] = []  # an abort's read events (given to on_output): the next step returns them

    # --- requests -----------------------------------------------------------------------------------------
    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Validate a prompt length and max_tokens; returns the effective max_tokens (None -> rest of context)."""
        if num_prompt_tokens <= 0:
            raise RequestError("the prompt is empty: it must contain at least one token", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestError(f"the prompt has {num_prompt_tokens} tokens; this server's context is "
                               f"{self.max_model_len} tokens, which must also leave room for at least one new "
                               "token", "prompt", "context_length_exceeded")
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            return room
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestError(f"max_tokens ({max_tokens}) plus the prompt ({num_prompt_tokens} tokens) exceeds "
                               f"this server's context of {self.max_model_len} tokens; at most {room} new tokens "
                               "fit", "max_tokens", "context_length_exceeded")
        return max_tokens

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Everything ``add_request`` checks about a prompt and its params (pure: safe from any thread)."""
        self.check_lengths(len(prompt_token_ids), params.max_tokens)
        vocab = self.backend.spec.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}), got {bad[0]!r}", "prompt")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}", "stop_token_ids")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {bad[0]}", "logit_bias")
        if params.grammar is not None and params.grammar.vocab_size != vocab:
            raise RequestError(f"the grammar was compiled for a vocabulary of {params.grammar.vocab_size} ids, "
                               f"the model has {vocab}", "response_format")

    @staticmethod
    def check_session_id(session_id: str | None) -> None:
        if session_id is not None and not (isinstance(session_id, str) and
                                           1 <= len(session_id) <= MAX_SESSION_ID_CHARS):
            raise RequestError(f"session_id must be a string of 1 to {MAX_SESSION_ID_CHARS} characters",
                               "session_id")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    arrival_time: float | None = None, session_id: str | None = None,
                    close_session: bool = False) -> Request:
        """Queue a request. ``session_id``: its session retains its pages when it finishes (unknown ids start a
        session; a recently closed one runs without retention); ``close_session``: close it after this request."""
        if request_id in self._requests:
            raise RequestError(f"duplicate request id {request_id!r}", "request_id")
        self.validate(prompt_token_ids, params)
        self.check_session_id(session_id)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, stop_ids, on_output, session_id=session_id)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        req.generator = make_generator(params)
        if params.grammar is not None:
            req.matcher = params.grammar.matcher()
        self._requests[request_id] = req
        self._detok[request_id] = TextStream(self.tokenizer, req.prompt_token_ids, params.stop)
        if session_id is not None:
            if self.sessions.begin(session_id, time.monotonic()):
                self._session_of[request_id] = session_id
            if close_session:
                self._close_after[request_id] = session_id
        self.scheduler.add(req)
        return req

    def close_session(self, session_id: str) -> bool:
        """Stop retaining a session's pages (they stay cached as ordinary pages); False if it was not live."""
        return self.sessions.close(session_id, time.monotonic())

    def abort(self, request_id: str) -> bool:
        """Cancel a request (frees its pages now); False if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if self._inflight is not None and req in self._inflight.rows:
            # its token in flight was generated before the abort: deliver it (the next step returns the events)
            self._held += self._resolve()
            if req.is_finished:
                return False
        self._finish(req, "abort", "")
        return True

    def abort_all(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)

    def fail_all(self, error: str) -> None:
        """End every request with finish_reason "error" (after an unexpected failure of a step)."""
        self._inflight, self._held = None, []
        for req in list(self._requests.values()):
            self._finish(req, "error", "", error=error, flush=False)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def stats(self) -> EngineStats:
        p = self.prefix
        h = self.host.stats() if self.host else None
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running), self.allocator.num_pages,
                           self.allocator.num_in_use, self.allocator.num_parked, p.query_tokens if p else 0,
                           p.hit_tokens if p else 0, self._preemptions, self._steps, self._prompt_tokens,
                           self._generation_tokens, self.speculator.stats() if self.speculator else None,
                           restoring=len(self.scheduler.loading), prefix_host_hit_tokens=p.host_hit_tokens if p else 0,
                           host_pages_total=h.pages_total if h else 0, host_pages_used=h.pages_used if h else 0,
                           kv_bytes_to_host=h.bytes_to_host if h else 0,
                           kv_bytes_to_device=h.bytes_to_device if h else 0, sessions_live=self.sessions.num_live,
                           step_tokens=self._step_tokens)

    # --- one step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the events it produced. With overlap (``engine/overlap.py``) these are mostly the
        previous step's: this step's tokens stay on the device until the next call (or a call that has nothing
        to run) reads them, while the device already runs the step after."""
        held, self._held = self._held, []
        return held + self._step()

    def _step(self) -> list[RequestOutput]:
        with phase("schedule"):
            self.sessions.expire(time.monotonic())
            if self.host is not None:
                self.host.poll()
            plan = self.scheduler.schedule()
        self._preemptions += len(plan.preempted)
        if not plan.chunks:
            return self._resolve()
        self._steps += 1
        start = time.monotonic()
        for c in plan.chunks:
            if c.request.scheduled_time is None:
                c.request.scheduled_time = start
        drafts = self.speculator.propose(plan, self.scheduler, self.max_model_len) if self.speculator else {}
        segments = [Segment(tuple(c.request.block_table), c.start, c.length + len(d), _num_logits(c) + len(d))
                    for c in plan.chunks for d in (drafts.get(c.request, NO_DRAFT).tokens,)]
        self._step_tokens += sum(s.length for s in segments)
        # a drafted chunk runs its draft too, with a logits row after each drafted token
        if self.host is not None:
            self.host.fence()  # this step may overwrite reallocated pages that copies still touch
        try:
            with phase("forward"):
                tokens = step_tokens(plan.chunks, drafts, self._inflight, self.backend.device)
                logits = self.backend.timed_forward(tokens, segments, self.cache)
        except Exception as e:  # a failed step fails its requests, never the engine
            out = self._resolve()
            return out + [self._finish(c.request, "error", "", error=f"{type(e).__name__}: {e}")
                          for c in plan.chunks if not c.request.is_finished]
        with phase("commit"):
            self.scheduler.commit(plan)
            if self.host is not None and self._backup_window > self.allocator.num_free:
                self.host.backup(self.prefix,  # type: ignore[arg-type]
                                 self._backup_window - self.allocator.num_free)
        ends = list(itertools.accumulate(s.num_logits for s in segments))  # row after each segment's last
        self._collect_prompt_logprobs(plan.chunks, segments, ends, logits)  # reads logits only where asked
        done = [c for c in plan.chunks if c.samples]
        for c in done:
            if not c.request.num_inflight and c.request.num_output_tokens == 0:  # prefill complete
                self._prompt_tokens += c.request.num_prompt_tokens
        # max_tokens 0 (scoring a prompt: its logprobs only) ends when the prompt is computed, sampling nothing
        out = [self._finish(c.request, "length", "") for c in done if c.request.params.max_tokens == 0]
        sampling = [(ends[i] - 1, c.request) for i, c in enumerate(plan.chunks)
                    if c.samples and c.request.params.max_tokens > 0 and c.request not in drafts]
        on_host, on_dev = [], []
        for i, r in sampling:
            (on_host if needs_host(r.params) else on_dev).append((i, r))
        with phase("sample"):
            launched = self._sample_on_device(logits, on_dev)
        if launched is None and len(on_host) < len(sampling):  # the device sampler failed: sample on the host
            on_host = sampling
        out += self._resolve()  # the previous step's tokens, read while this step runs
        if launched is not None:
            launched.mark()
            self._inflight = launched
        out += self._verify_drafts(plan.chunks, drafts, ends, logits)
        if on_host:
            out += self._sample_on_host(logits, on_host)
        if not self._overlap or on_host or drafts or any(s.num_logits > 1 for s in segments):
            out += self._resolve()  # the next step needs this one's tokens on the host
        return out

    def _sample_on_device(self, logits: torch.Tensor, rows: list[tuple[int, Request]]) -> InFlight | None:
        """Sample ``rows`` (logits row, request) into a device tensor and start its copy to the host; None when
        there is nothing to sample or the sampler failed."""
        if not rows:
            return None
        reqs = [r for _, r in rows]
        params = [r.params for r in reqs]
        try:
            x = logits if [i for i, _ in rows] == list(range(logits.shape[0])) else \
                logits.index_select(0, on_device([i for i, _ in rows], torch.long, logits.device))
            ids = sample_ids(x, params, draw_uniforms(params, [r.generator for r in reqs]), argmax=self._argmax)
        except Exception:  # e.g. a generator missing: the host path samples these rows and reports the culprits
            return None
        return InFlight(reqs, ids, may_fail=not all(p.greedy for p in params), ring=self._ids_ring)

    def _resolve(self) -> list[RequestOutput]:
        """Read the tokens in flight (waiting for their copy) and append them with every stop check."""
        f, self._inflight = self._inflight, None
        if f is None:
            return []
        with phase("read"):
            ids = f.read()
        now = time.monotonic()
        out = []
        with phase("append"):
            for r, t in zip(f.requests, ids):
                if r.is_finished:  # aborted, or ended by the token before: its token is discarded unseen
                    continue
                if t < 0:
                    out.append(self._finish(r, "error", "", error="sampling failed: the logits give no valid "
                                            "sampling distribution (NaN or infinite values)"))
                else:
                    out.append(self._append_safely(r, [t], now))
        return out

    def _sample_on_host(self, logits: torch.Tensor, rows: list[tuple[int, Request]]) -> list[RequestOutput]:
        """Sample ``rows`` with what only the host has (penalty histories, grammar masks) and report logprobs."""
        idx = [i for i, _ in rows]
        reqs = [r for _, r in rows]
        try:
            contexts = [_context(r) for r in reqs] if any(r.params.has_processors for r in reqs) else None
            new: list[int | Exception] = list(sample_batch(logits[idx], [r.params for r in reqs],
                                                           [r.generator for r in reqs], contexts))
        except Exception:  # e.g. NaN logits under temperature sampling: find the culprits one by one
            new = [self._sample_one(logits[i], r) for i, r in zip(idx, reqs)]
        lps = self._token_logprobs(logits, idx, reqs, new)
        now = time.monotonic()
        return [self._finish(r, "error", "", error=f"sampling failed: {type(t).__name__}: {t}")
                if isinstance(t, Exception) else self._append_safely(r, [t], now, (lp,))
                for r, t, lp in zip(reqs, new, lps)]

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, rows: list[int], reqs: list[Request],
                        new: list[int | Exception]) -> list[TokenLogprob | None]:
        """Logprob (and top alternatives) of each sampled token whose request asked for them."""
        want = [i for i, (r, t) in enumerate(zip(reqs, new))
                if r.params.logprobs is not None and not isinstance(t, Exception)]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if want:
            got = logprobs_of(logits[[rows[i] for i in want]], [new[i] for i in want],
                              [reqs[i].params.logprobs for i in want])
            for i, lp in zip(want, got):
                out[i] = lp
        return out

    @staticmethod
    def _collect_prompt_logprobs(chunks, segments: list[Segment], ends: list[int], logits: torch.Tensor) -> None:
        """Prompt logprobs from the chunks that asked for a row per token: the row of position q scores prompt
        token q + 1. Positions already collected (a recomputation after preemption) are skipped."""
        rows, targets, ks, owners = [], [], [], []
        for c, seg, end in zip(chunks, segments, ends):
            r = c.request
            q0 = len(r.prompt_logprobs)  # the next position to score
            if seg.num_logits != c.length or not r.needs_prompt_logits or q0 < c.start:
                continue  # (q0 < c.start cannot happen: no prefix reuse while collecting; never misalign)
            first_row = end - seg.num_logits  # the row of position c.start
            for q in range(q0, min(c.start + c.length, r.num_prompt_tokens - 1)):
                rows.append(first_row + q - c.start)
                targets.append(r.token_ids[q + 1])
                ks.append(r.params.prompt_logprobs)
                owners.append(r)
        if rows:
            for r, lp in zip(owners, logprobs_of(logits[rows], targets, ks)):
                r.prompt_logprobs.append(lp)

    def _append_safely(self, r: Request, tokens: list[int], now: float, lps: Sequence[TokenLogprob | None] = (),
                       drafted: bool = False) -> RequestOutput:
        try:
            out = self._append(r, tokens, now, lps)
        except Exception as e:  # e.g. the tokenizer cannot decode an id: this request fails, the others go on
            if r.request_id not in self._requests:
                raise
            return self._finish(r, "error", "", error=f"detokenisation failed: {type(e).__name__}: {e}",
                                flush=False)
        if drafted and not r.is_finished:  # the accepted drafts' K/V count; the rejected ones' pages go back
            self.scheduler.advance(r, len(tokens) - 1)
        return out

    def _verify_drafts(self, chunks, drafts: dict, ends: list[int], logits: torch.Tensor) -> list[RequestOutput]:
        """Verify each drafted chunk's block (its last 1 + k logits rows) and append what it emits."""
        out = []
        for c, end in zip(chunks, ends):
            r = c.request
            if r not in drafts:
                continue
            block = logits[end - 1 - len(drafts[r]):end]  # row j: the target's logits for emitted token j
            try:
                tokens = self.speculator.verify(r, block, drafts[r])  # type: ignore[union-attr]
            except Exception as e:  # e.g. NaN logits under temperature sampling: this request fails
                out.append(self._finish(r, "error", "", error=f"sampling failed: {type(e).__name__}: {e}"))
                continue
            k = r.params.logprobs
            lps = logprobs_of(block[:len(tokens)], tokens, [k] * len(tokens)) if k is not None else ()
            out.append(self._append_safely(r, tokens, time.monotonic(), lps, drafted=True))
        return out

    @staticmethod
    def _sample_one(logits: torch.Tensor, r: Request) -> int | Exception:
        try:
            ctx = [_context(r)] if r.params.has_processors else None
            return sample_batch(logits[None], [r.params], [r.generator], ctx)[0]
        except Exception as e:
            return e

    def _append(self, r: Request, tokens: list[int], now: float,
                lps: Sequence[TokenLogprob | None] = ()) -> RequestOutput:
        """Append tokens one by one with every stop check of each; a stop ends the request and drops the rest.
        ``lps[i]``: the logprob report of tokens[i], if its request asked for one."""
        if r.first_token_time is None:
            r.first_token_time = now
        stream = self._detok[r.request_id]
        text, got = "", []
        for n, token in enumerate(tokens, 1):
            r.token_ids.append(token)
            self._generation_tokens += 1
            if r.matcher is not None and not r.matcher.accept(token):
                return self._finish(r, "error", "", error=f"token {token} is outside the request's grammar",
                                    flush=False)
            if token in r.stop_token_ids:
                return self._finish(r, "stop", text, tuple(tokens[:n]), logprobs=tuple(got))
            if n <= len(lps) and lps[n - 1] is not None:
                got.append(lps[n - 1])
            delta, stopped = stream.push(token)
            text += delta
            if stopped:  # the stop string and everything after it are dropped: nothing to flush
                return self._finish(r, "stop", text, tuple(tokens[:n]), flush=False, logprobs=tuple(got))
            if r.matcher is not None and r.matcher.finished:  # the document is complete (even with ignore_eos)
                return self._finish(r, "stop", text, tuple(tokens[:n]), logprobs=tuple(got))
            known = len(r.token_ids)  # (num_output_tokens and num_tokens, inline: this runs for every token)
            if known - r.num_prompt_tokens >= r.params.max_tokens or known + r.num_inflight >= self.max_model_len:
                return self._finish(r, "length", text, tuple(tokens[:n]), logprobs=tuple(got))
        return self._event(r, text, tuple(tokens), logprobs=tuple(got))

    def _finish(self, r: Request, reason: str, text: str, token_ids: tuple[int, ...] = (),
                error: str | None = None, flush: bool = True,
                logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
        """End ``r``: free its pages and emit the last event, with any text held back so far when ``flush``."""
        stream = self._detok.pop(r.request_id)
        del self._requests[r.request_id]
        if flush:
            text += stream.finish()
        now = time.monotonic()
        sid = self._session_of.pop(r.request_id, None)
        if sid is not None:  # before the pages are released, so that they park as the session's
            done = reason in ("stop", "length")
            self.sessions.end(sid, tuple(r.page_hashes[:r.num_registered]) if done else None, now)
        self.scheduler.finish(r, reason)
        if self.speculator is not None:
            self.speculator.finish(r)
        close = self._close_after.pop(r.request_id, None)
        if close is not None:
            self.sessions.close(close, now)
        return self._event(r, text, token_ids, error, logprobs)

    def _event(self, r: Request, text: str, token_ids: tuple[int, ...], error: str | None = None,
               logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
        prompt_lps = None
        if r.params.prompt_logprobs is not None and not r.prompt_logprobs_sent and (token_ids or r.is_finished):
            r.prompt_logprobs_sent = True
            prompt_lps = (None, *r.prompt_logprobs)
        times = RequestTimes(r.arrival_time, r.scheduled_time, r.first_token_time, time.monotonic()) \
            if r.is_finished else None
        out = RequestOutput(r.request_id, text, token_ids, r.is_finished, r.finish_reason, r.num_prompt_tokens,
                            r.num_output_tokens, r.num_cached_tokens, error, logprobs, prompt_lps, times)
        if r.on_output is not None:
            try:
                r.on_output(out)
            except Exception:  # a consumer that went away must not stop the other requests
                pass
        return out


def _num_logits(c) -> int:
    """Logit rows a chunk needs: one per token while its request still collects prompt logprobs, else one."""
    r = c.request
    return c.length if r.needs_prompt_logits and c.start < r.num_prompt_tokens - 1 else 1


def _context(r: Request) -> TokenContext:
    """What the sampling processors read about ``r``: its history (penalties) and its grammar's next mask."""
    p = r.params
    return TokenContext(r.prompt_token_ids if p.repetition_penalty != 1 else (),
                        r.output_token_ids if p.has_penalties else (),
                        r.matcher.allowed() if r.matcher is not None else None)
