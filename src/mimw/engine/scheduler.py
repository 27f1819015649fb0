"""Scheduler: which tokens of which requests run in the next step, and which pages they write.

Continuous batching: requests join (admission) and leave (finish, abort, preemption) between any two steps. A
step mixes decodes (1 token) and prefill chunks under a token budget (``max_step_tokens``); a long prompt is
prefilled over several steps (chunked prefill) while the running requests keep decoding.

Policy, oldest request first (FCFS):
  1. Running requests in admission order. A decoding request takes 1 token; a prefilling one takes its fair share
     (``chunking``) of the budget left after 1 token for every decoder: shared with the other prefilling requests
     and with the first waiting request when it could be admitted, by max-min fairness, and - when decoders share
     the step - measured by cost (its tokens' attention over their context counted, ``attention_cost_tokens``) so
     that a chunk deep into a long prompt is shorter. A step with no decoder has ``max_prefill_step_tokens``.
     If the pages for its chunk are not available, the chunk shrinks to what fits; if nothing fits, the newest
     running request is preempted (pages released, recomputed later) until it does - or, when it is itself the
     newest, it is preempted. The oldest request therefore always progresses: never a deadlock, never a crash,
     as long as a single request fits in the pool alone (the engine checks that at submission).
  2. Waiting requests (preempted ones first, then arrival order) while there is budget, batch room and pages:
     full pages of the request's tokens found in the prefix cache are shared instead of recomputed. Admission
     never preempts, and keeps one spare page per running request so that decoders do not immediately evict it.
     With a host tier, the prefix continues through pages the host holds: they get fresh device pages and one
     restore copy, and the request waits in ``loading`` (not the step) until they have arrived; then it joins
     the running requests. Loading requests count against ``max_batch``. A request whose host pages do not fit
     yet waits while other requests run (restoring later beats recomputing now).
  Finished and preempted requests release their pages last page first, so that among pages released together
  the tail of a prefix is evicted before its head (a chain broken at its head matches nothing).

With the overlapped engine (``engine/overlap.py``) a request may have one token in flight (sampled on the device,
not read yet): it counts as a token to run like any other, except that a request whose in-flight token is its
last (``Request.last_in_flight``) takes no part in the step.

Pure host logic (no tensors): the engine turns a ``StepPlan`` into backend calls, then calls ``commit``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..kv.allocator import PageAllocator
from ..kv.host_tier import HostKVTier
from ..kv.prefix import PrefixCache, chain_hashes
from .chunking import chunk_cost, fair_shares, tokens_within
from .request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_batch: int = 32  # running requests at most
    max_step_tokens: int = 512  # tokens per step (prefill chunks + decodes)
    max_prefill_step_tokens: int = 0  # tokens of a step in which no request decodes (0: max_step_tokens)
    attention_cost_tokens: int = 0  # R of the chunk cost model (``chunking``); 0: a chunk costs its tokens

    def __post_init__(self) -> None:
        for f in ("page_size", "max_batch", "max_step_tokens"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        for f in ("max_prefill_step_tokens", "attention_cost_tokens"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.max_step_tokens < self.max_batch:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be >= max_batch ({self.max_batch}) "
                             "so that every running request can decode each step")


@dataclass(frozen=True)
class Chunk:
    """Run tokens [start, start+length) of ``request``; sample a token after it iff ``samples``."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.request.num_tokens


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[Chunk, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, prefix: PrefixCache | None,
                 host: HostKVTier | None = None):
        self.cfg = config
        self.alloc = allocator
        self.prefix = prefix
        self.host = host if prefix is not None else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, waiting for prefix pages restored from the host tier

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # --- planning -----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._promote_loaded()
        chunks: list[Chunk] = []
        preempted: list[Request] = []
        decoders_behind = sum(1 for r in self.running if r.num_pending == 1 and not r.last_in_flight)
        budget = self.cfg.max_step_tokens
        if not decoders_behind and self.cfg.max_prefill_step_tokens:
            budget = self.cfg.max_prefill_step_tokens
        r_cost = self.cfg.attention_cost_tokens if decoders_behind else 0
        share = self._prefill_shares(budget - decoders_behind, r_cost)
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r.last_in_flight:  # the token the device holds for it ends it (engine/overlap.py)
                i += 1
                continue
            if r.num_pending == 1:
                decoders_behind -= 1
                want = 1
            else:
                want = min(share.get(id(r), 0), budget - decoders_behind)
            # room in its last page is enough for most decode tokens: the pool is asked only past it
            room = len(r.block_table) * self.cfg.page_size - r.num_computed
            n = 0 if want <= 0 else want if room >= want else min(want, self._fits(r))
            while want > 0 and n == 0:  # make room: preempt the newest running request
                victim = self.running[-1]
                if victim.num_pending == 1 and victim is not r and not victim.last_in_flight:
                    decoders_behind -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
                n = min(want, self._fits(r))
            if r.status is not Status.RUNNING:
                break  # r was the newest and got preempted: nothing behind it
            if n > 0:
                chunks.append(self._take(r, n))
                budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.cfg.max_batch:
            r = self.waiting[0]
            chunk = self._admit(r, budget, r_cost)
            if r.status is Status.WAITING:
                break
            self.waiting.popleft()
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.length
        return StepPlan(tuple(chunks), tuple(preempted))

    def _prefill_shares(self, budget: int, r_cost: int) -> dict[int, int]:
        """Tokens each prefilling running request may take (by id): fair shares of ``budget`` (cost units when
        ``r_cost``) among them and the first waiting request if it could be admitted now."""
        prefilling = [r for r in self.running if r.num_pending > 1]
        if not prefilling:
            return {}
        cands = list(prefilling)
        if (self.waiting and len(self.running) + len(self.loading) < self.cfg.max_batch
                and self.alloc.num_available > len(self.running)):
            cands.append(self.waiting[0])
        shares = fair_shares(budget, [chunk_cost(r.num_pending, r.num_computed, r_cost) for r in cands])
        return {id(r): tokens_within(c, r.num_computed, r.num_pending, r_cost)
                for r, c in zip(prefilling, shares)}

    def _promote_loaded(self) -> None:
        for r in [r for r in self.loading if self.host.ready(r.block_table)]:  # type: ignore[union-attr]
            self.loading.remove(r)
            r.status = Status.RUNNING
            self.running.append(r)

    def _fits(self, r: Request, spare: int = 0) -> int:
        """Tokens of r's next chunk whose pages can be had now (room in its last page + available pages)."""
        ps = self.cfg.page_size
        room = len(r.block_table) * ps - r.num_computed
        return room + max(0, self.alloc.num_available - spare) * ps

    def _take(self, r: Request, n: int) -> Chunk:
        need = -(-(r.num_computed + n) // self.cfg.page_size) - len(r.block_table)
        if need > 0:
            r.block_table.extend(self.alloc.allocate(need))
        return Chunk(r, r.num_computed, n)

    def _admit(self, r: Request, budget: int, r_cost: int = 0) -> Chunk | None:
        """Admit ``r`` (status RUNNING with its first chunk, or LOADING without one) or leave it WAITING."""
        ps = self.cfg.page_size
        spare = len(self.running)
        restored = 0
        if self.prefix is not None and not r.needs_prompt_logits:  # prompt logprobs need every prompt row
            hashes = chain_hashes(r.token_ids, ps, r.page_hashes)
            usable = (r.num_tokens - 1) // ps  # keep >= 1 token to compute: the next token needs its logits
            matched = self._match(hashes[:usable], spare)
            if matched is None:
                return None  # its prefix is in the host tier but does not fit yet: wait rather than recompute
            r.block_table, restored = matched
            r.num_registered = len(r.block_table)  # pages, all already in the prefix cache
            r.num_computed = r.num_registered * ps
        loading = self.host is not None and not self.host.ready(r.block_table)
        n = min(tokens_within(budget, r.num_computed, r.num_pending, r_cost), self._fits(r, spare=spare))
        if n <= 0 and not loading:
            self.alloc.release(reversed(r.block_table))
            r.block_table, r.num_computed, r.num_registered = [], 0, 0
            return None
        if not r.admitted_once:
            r.admitted_once = True
            r.num_cached_tokens = r.num_computed
            r.num_host_cached_tokens = restored * ps
            if self.prefix is not None:
                self.prefix.record_lookup(r.num_prompt_tokens, r.num_computed, restored * ps)
        if loading:
            r.status = Status.LOADING
            self.loading.append(r)
            return None
        r.status = Status.RUNNING
        self.running.append(r)
        return self._take(r, n)

    def _match(self, hashes: list[bytes], spare: int) -> tuple[list[int], int] | None:
        """Pages of the longest cached prefix of ``hashes``, each from the device cache (shared) or, failing that,
        from the host tier (restored into fresh pages); returns (block table, number of restored pages).
        Restores must leave ``spare`` + 1 pages for the running requests and the request's first chunk. When they
        would not and other requests run or load (and will free pages), returns None: the request waits, since
        restoring its prefix later costs far less than recomputing it now; with nothing else in flight it takes
        the restores that fit."""
        assert self.prefix is not None
        plan: list[int | bytes] = []  # a device page, or the hash of a host page to restore
        room = self.alloc.num_available - spare - 1
        for h in hashes:
            p = self.prefix.lookup(h)
            if p is not None:
                room -= self.alloc.refcount(p) == 0  # sharing a parked page takes it out of the available ones
                plan.append(p)
            elif self.host is not None and self.host.lookup(h) is not None:
                if room <= 0:
                    if self.running or self.loading:
                        return None
                    break
                room -= 1
                plan.append(h)
            else:
                break
        self.alloc.share([x for x in plan if isinstance(x, int)])  # first: the allocation below may evict
        want = [x for x in plan if isinstance(x, bytes)]
        if not want:
            return list(plan), 0  # type: ignore[arg-type]
        assert self.host is not None
        self.host.hold(want)  # the evictions below may offload to the host: keep these pages there
        fresh = self.alloc.allocate(len(want))
        self.host.restore(want, fresh)
        it = iter(fresh)
        table = []
        for x in plan:
            if isinstance(x, bytes):
                p = next(it)
                registered = self.prefix.insert(x, p)
                assert registered, "a restored page's hash is already cached on the device"
                table.append(p)
            else:
                table.append(x)
        return table, len(want)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._free(r)
        r.num_preemptions += 1
        r.status = Status.WAITING
        self.waiting.appendleft(r)

    # --- after the step ---------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """The backend wrote the planned K/V: advance the requests and offer newly full pages for reuse."""
        for c in plan.chunks:
            c.request.num_computed = c.start + c.length
            self._register(c.request)

    def _register(self, r: Request) -> None:
        """Offer r's full pages of computed and known tokens to the prefix cache (a page whose last token is still
        in flight on the device is offered at a later commit, once the host has it)."""
        ps = self.cfg.page_size
        full = min(r.num_computed, len(r.token_ids)) // ps
        if self.prefix is None or full <= r.num_registered:
            return
        hashes = chain_hashes(r.token_ids, ps, r.page_hashes, full)
        for i in range(r.num_registered, full):
            self.prefix.insert(hashes[i], r.block_table[i])
        r.num_registered = full

    # --- speculative positions ---------------------------------------------------------------------------------
    def extend(self, r: Request, n: int) -> int:
        """Pages for up to ``n`` positions past r's token_ids (a draft verified in this step's chunk of r, planned
        to end at r's last token). Never preempts, and leaves a spare page per running request; returns how many
        of the n positions are covered."""
        ps = self.cfg.page_size
        room = len(r.block_table) * ps - r.num_tokens
        pages = max(0, min(-(-(n - room) // ps), self.alloc.num_available - len(self.running)))
        r.block_table.extend(self.alloc.allocate(pages))
        return max(0, min(n, room + pages * ps))

    def advance(self, r: Request, accepted: int) -> None:
        """After ``commit``: ``accepted`` drafted tokens, now appended to r.token_ids, hold valid K/V; they count as
        computed (and their full pages go to the prefix cache). Pages past them - written only by rejected draft
        tokens - are released, so no rejected K/V is ever shared or counted."""
        r.num_computed += accepted
        if not r.num_computed < r.num_tokens:
            raise ValueError(f"advance past the last token of {r.request_id}")
        self._register(r)
        keep = -(-r.num_computed // self.cfg.page_size)
        if len(r.block_table) > keep:
            self.alloc.release(r.block_table[keep:])
            del r.block_table[keep:]

    def finish(self, r: Request, reason: str) -> None:
        """End a request (any state): release its pages and drop it from the queues."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r.status is Status.LOADING:
            self.loading.remove(r)
        elif r.status is Status.WAITING:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        self._free(r)
        r.status = Status.FINISHED
        r.finish_reason = reason

    def _free(self, r: Request) -> None:
        self.alloc.release(reversed(r.block_table))  # tail first: the head of a prefix stays cached longest
        r.block_table = []
        r.num_computed = 0
        r.num_registered = 0
