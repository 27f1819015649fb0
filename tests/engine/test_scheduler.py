"""Scheduler policy on host-only requests (no model): budgets, batching, admission, preemption, prefix hits."""
import pytest

from mimw.engine.request import Request, Status
from mimw.engine.sampling import SamplingParams
from mimw.engine.scheduler import Scheduler, SchedulerConfig
from mimw.kv.allocator import PageAllocator
from mimw.kv.prefix import PrefixCache

P = SamplingParams(temperature=0, max_tokens=100)


def make(num_pages=64, page_size=4, max_batch=8, max_step_tokens=32, prefix=True, **chunking):
    pc = PrefixCache(page_size) if prefix else None
    return Scheduler(SchedulerConfig(page_size, max_batch, max_step_tokens, **chunking), PageAllocator(num_pages, pc),
                     pc)


def req(name, n, first=1):
    return Request(name, list(range(first, first + n)), P)


def step(s, new_token=7):
    """One engine step without a model: commit the plan, append a token to every request that samples."""
    plan = s.schedule()
    s.commit(plan)
    for c in plan.chunks:
        if c.samples:
            c.request.token_ids.append(new_token)
    return plan


def check_pages(s):
    held = [p for r in s.running for p in r.block_table]
    assert len(held) >= len(set(held))
    for r in s.running:
        assert len(r.block_table) == -(-r.num_computed // s.cfg.page_size)
    assert s.alloc.num_in_use == len(set(held))


def test_config_rejects_budget_below_batch():
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(16, 8, 4)


def test_token_budget_and_chunked_prefill():
    s = make(max_step_tokens=10)
    a = req("a", 25)
    s.add(a)
    sizes = [step(s).num_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]  # prefilled in chunks, the last chunk samples
    assert a.num_output_tokens == 1 and a.num_pending == 1
    check_pages(s)


def test_new_requests_join_between_steps_and_decoders_keep_going():
    s = make(max_step_tokens=12)
    a = req("a", 4)
    s.add(a)
    step(s)
    assert a.num_pending == 1  # decoding now
    b = req("b", 30, first=50)
    s.add(b)
    plan = step(s)
    # a decodes (1 token) while b prefills a chunk with the rest of the budget
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 1), ("b", 11)]
    plan = step(s)
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 1), ("b", 11)]
    check_pages(s)


def test_prefilling_request_reserves_budget_for_decoders_behind_it():
    s = make(max_step_tokens=8)
    a, b = req("a", 40), req("b", 3, first=60)
    s.add(b)
    step(s)  # b is decoding
    s.running.reverse()  # pretend a is older than b
    s.add(a)
    step(s)
    s.running.sort(key=lambda r: r.request_id)  # a first, then the decoder b
    plan = step(s)
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 7), ("b", 1)]


def test_max_batch_limits_running_requests():
    s = make(max_batch=2, max_step_tokens=64)
    for i in range(4):
        s.add(req(f"r{i}", 3, first=10 * i + 1))
    plan = step(s)
    assert len(plan.chunks) == 2 and len(s.waiting) == 2
    s.finish(s.running[0], "stop")
    plan = step(s)
    assert {c.request.request_id for c in plan.chunks} == {"r1", "r2"}


def test_preemption_under_page_pressure_never_deadlocks():
    # 6 pages of 4 tokens; two requests of 8 prompt tokens each need 2 pages, then grow by one page / 4 tokens
    s = make(num_pages=6, page_size=4, max_batch=4, max_step_tokens=32)
    a, b = req("a", 8), req("b", 8, first=40)
    s.add(a), s.add(b)
    preempted = []
    for _ in range(40):
        plan = step(s)
        preempted += [r.request_id for r in plan.preempted]
        check_pages(s)
        assert plan.chunks, "no progress"
        if a.num_output_tokens >= 12:
            break
    assert a.num_output_tokens >= 12  # the oldest request always progresses
    assert "b" in preempted and "a" not in preempted
    assert b.status is Status.WAITING or b.num_preemptions > 0


def test_lone_request_that_outgrows_the_pool_preempts_itself_instead_of_crashing():
    s = make(num_pages=2, page_size=4)
    a = req("a", 7)
    s.add(a)
    step(s), step(s)
    assert a.num_tokens == 9 and a.num_computed == 8  # both pages full
    plan = step(s)  # position 8 needs a third page: a preempts itself rather than crash
    assert plan.preempted == (a,) and plan.chunks == () and s.running == [] and s.waiting[0] is a
    plan = s.schedule()  # and it stays queued (the engine never admits a request longer than the pool)
    assert plan.chunks == () and s.alloc.num_in_use == 0


def test_prefix_pages_are_shared_and_the_last_token_is_recomputed():
    s = make(page_size=4)
    a = req("a", 10)
    s.add(a)
    step(s)
    assert a.num_registered == 2  # two full pages written
    b = req("b", 8)  # exactly the first two pages of a
    s.add(b)
    plan = step(s)
    chunk = [c for c in plan.chunks if c.request is b][0]
    # page 0 is shared; page 1 would hold b's last token, which must run to produce logits
    assert b.num_cached_tokens == 4 and chunk.start == 4 and chunk.length == 4
    assert b.block_table[0] == a.block_table[0] and s.alloc.refcount(a.block_table[0]) == 2
    c = req("c", 12)  # a's 10 tokens + 7 + 2 more: shares a's 2 full pages
    s.add(c)
    step(s)
    assert c.num_cached_tokens == 8 and s.prefix.hit_rate > 0
    for r in list(s.running):
        s.finish(r, "stop")
    assert s.alloc.num_in_use == 0 and s.alloc.num_parked > 0


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_page_accounting_exact(seed):
    """Random arrivals, lengths, finishes and pool sizes: at every step each page is free, parked or held
    (refcount = number of block tables holding it), budgets and batch limits hold, and the pool drains to 0."""
    import random
    rng = random.Random(seed)
    s = make(num_pages=rng.randint(6, 30), page_size=rng.choice([2, 4]), max_batch=rng.randint(1, 6),
             max_step_tokens=rng.randint(6, 40), max_prefill_step_tokens=rng.choice([0, 50]),
             attention_cost_tokens=rng.choice([0, 3, 40]))
    alive = []
    for it in range(120):
        if rng.random() < 0.3:  # shared prefixes exercise the prefix cache
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            r = Request(f"r{it}", base + [rng.randint(1, 5) for _ in range(rng.randint(1, 10))], P)
            s.add(r)
            alive.append(r)
        decoding = any(r.num_pending == 1 for r in s.running)
        plan = step(s, new_token=rng.randint(1, 3))
        prefill_only = s.cfg.max_prefill_step_tokens and not decoding
        assert plan.num_tokens <= (s.cfg.max_prefill_step_tokens if prefill_only else s.cfg.max_step_tokens)
        assert len(s.running) <= s.cfg.max_batch
        for r in list(alive):
            if r.num_output_tokens >= rng.randint(1, 12) or rng.random() < 0.05:
                s.finish(r, "stop")
                alive.remove(r)
        check_pages(s)
        held = [p for r in s.running for p in r.block_table]
        for p in set(held):
            assert s.alloc.refcount(p) == held.count(p)
        assert s.alloc.num_free + s.alloc.num_parked + len(set(held)) == s.alloc.num_pages
        assert all(not r.block_table for r in s.waiting)
    for r in alive:
        s.finish(r, "stop")
    assert s.alloc.num_in_use == 0


def chunks_of(plan):
    return [(c.request.request_id, c.length) for c in plan.chunks]


def test_long_prompts_of_several_requests_interleave_fairly():
    s = make(max_step_tokens=20)
    a, b = req("a", 50), req("b", 50, first=100)
    s.add(a), s.add(b)
    assert chunks_of(step(s)) == [("a", 20)]  # admission: b finds no budget left
    assert chunks_of(step(s)) == [("a", 10), ("b", 10)]  # b, first in line, shares the prefill budget
    assert chunks_of(step(s)) == [("a", 10), ("b", 10)]
    check_pages(s)


def test_a_short_prompt_behind_a_long_prefill_is_done_in_one_step():
    s = make(max_step_tokens=32)
    a = req("a", 200)
    s.add(a)
    step(s)
    b = req("b", 5, first=300)
    s.add(b)
    assert chunks_of(step(s)) == [("a", 27), ("b", 5)]  # water-filling: b needs less than its share
    assert b.num_output_tokens == 1


def test_fair_shares_keep_the_oldest_progressing_when_the_budget_is_short():
    s = make(max_step_tokens=4, max_batch=4)
    reqs = [req(f"r{i}", 30, first=40 * i + 1) for i in range(4)]
    for r in reqs:
        s.add(r)
    for _ in range(4):
        step(s)
    plan = step(s)
    assert plan.num_tokens <= 4 and plan.chunks[0].request is reqs[0]


def test_a_step_without_decoders_has_the_prefill_budget():
    s = make(max_step_tokens=16, max_prefill_step_tokens=64)
    a = req("a", 100)
    s.add(a)
    assert chunks_of(step(s)) == [("a", 64)]
    assert chunks_of(step(s)) == [("a", 36)]  # a samples: it decodes from now on
    b = req("b", 100, first=200)
    s.add(b)
    assert chunks_of(step(s)) == [("a", 1), ("b", 15)]  # a decoder shares the step: the decode budget


def test_with_decoders_a_chunk_is_sized_by_its_cost_and_shrinks_as_its_context_grows():
    from mimw.engine.chunking import chunk_cost

    r = 16
    s = make(num_pages=200, max_step_tokens=20, attention_cost_tokens=r)
    d = req("d", 3)
    s.add(d)
    step(s)  # d decodes from now on
    a = req("a", 300, first=100)
    s.add(a)
    lengths = []
    for _ in range(8):
        plan = step(s)
        c = [c for c in plan.chunks if c.request is a][0]
        assert chunk_cost(c.length, c.start, r) <= 19 or c.length == 1  # the budget after d's token
        assert [x.request for x in plan.chunks].count(d) == 1  # the decoder runs every step
        lengths.append(c.length)
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] < lengths[0]
