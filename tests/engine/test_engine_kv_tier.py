"""The host tier and sessions end to end on a tiny random model: pages restored from the host hold bit-identical
K/V and give the recomputed greedy output; a restore holds only its request; session retention and LRU differ as
designed; TTL expiry and close release everything."""
import time

import pytest
import torch
from engine_helpers import ByteTokenizer, greedy_alone, run_all

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig, RequestError
from mimw.engine.request import Status
from mimw.engine.sampling import SamplingParams
from mimw.kv.prefix import chain_hashes
from mimw.kv.transfer import DeferredCopier

PS = 4


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(events):
    return [t for e in events for t in e.token_ids]


def engine(weights, host_pages=0, copier=None, **cfg):
    base = dict(num_pages=16, page_size=PS, max_batch=4, max_step_tokens=64)
    base.update(cfg)
    eng0 = Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(**base))
    per_page = sum(t[:, 0].numel() * t.element_size() for t in eng0.cache.page_tensors())
    return Engine(ReferenceBackend(weights), ByteTokenizer(),
                  EngineConfig(**base, host_kv_bytes=host_pages * per_page), host_copier=copier)


def page_contents(eng, hashes):
    """K/V of every cached device page named in ``hashes`` (by hash)."""
    out = {}
    for h in hashes:
        p = eng.prefix.lookup(h)
        if p is not None:
            out[h] = [t[:, p].clone() for t in eng.cache.page_tensors()]
    return out


def run_copying(eng, copier):
    """run_all with a DeferredCopier: every pending copy completes after each step."""
    events = {}
    for _ in range(10_000):
        if not eng.has_work():
            return events
        for ev in eng.step():
            events.setdefault(ev.request_id, []).append(ev)
        copier.run()
    raise AssertionError("engine did not finish")


def flood(eng, n=3, length=40, first=100):
    """Run unrelated requests that need the whole device pool, evicting everything cached."""
    for i in range(n):
        eng.add_request(f"flood{first + i}", [first + i] * 3 + list(range(50, 50 + length - 3)), greedy(2))
        run_all(eng)


def test_a_request_served_from_host_pages_is_bit_exact_and_gives_the_recomputed_tokens(tiny_weights):
    eng = engine(tiny_weights, host_pages=64)
    a = list(range(3, 31))  # 7 full pages
    eng.add_request("a", a, greedy(4))
    first = tokens(run_all(eng)["a"])
    hashes = chain_hashes(a + first, PS)
    before = page_contents(eng, hashes)
    assert len(before) == 7
    flood(eng)
    hashes = hashes[:7]  # the last page holds the final token, whose K/V is never computed
    assert all(eng.prefix.lookup(h) is None for h in hashes) and all(eng.host.lookup(h) is not None for h in hashes)
    a2 = a + first + [7, 8, 9, 10, 11]
    req = eng.add_request("a2", a2, greedy(6))
    out = tokens(run_all(eng)["a2"])
    assert req.num_host_cached_tokens == 28 and req.num_cached_tokens == 28
    after = page_contents(eng, hashes)
    for h, kv in before.items():
        assert all(torch.equal(x, y) for x, y in zip(kv, after[h])), "restored K/V differs from the original"
    assert out == greedy_alone(tiny_weights, a2, 6)
    s = eng.stats()
    assert s.prefix_host_hit_tokens == 28 and s.kv_bytes_to_device == 7 * eng.host.page_bytes
    assert s.kv_bytes_to_host >= 7 * eng.host.page_bytes and s.pages_in_use == 0


def test_without_a_host_tier_the_same_request_recomputes(tiny_weights):
    eng = engine(tiny_weights)
    a = list(range(3, 31))
    eng.add_request("a", a, greedy(4))
    first = tokens(run_all(eng)["a"])
    flood(eng)
    req = eng.add_request("a2", a + first, greedy(3))
    run_all(eng)
    assert req.num_cached_tokens == 0 and eng.stats().host_pages_total == 0


def test_a_pending_restore_holds_its_request_not_the_engine(tiny_weights):
    copier = DeferredCopier()
    eng = engine(tiny_weights, host_pages=64, copier=copier)
    a = list(range(3, 31))
    eng.add_request("a", a, greedy(2))
    run_all(eng)
    flood(eng)
    copier.run()
    b = eng.add_request("b", [200, 201, 202], greedy(6))
    restored = eng.add_request("a2", a + [9], greedy(3))
    done = {}
    for _ in range(4):  # the restore has not run: a2 waits, b decodes
        for ev in eng.step():
            done.setdefault(ev.request_id, []).append(ev)
    assert restored.status is Status.LOADING and eng.stats().restoring == 1
    assert len(tokens(done["b"])) + b.num_inflight == 4 and "a2" not in done  # (overlap: the last one in flight)
    copier.run()
    for k, v in run_copying(eng, copier).items():
        done.setdefault(k, []).extend(v)
    assert tokens(done["a2"]) == greedy_alone(tiny_weights, a + [9], 3)
    assert tokens(done["b"]) == greedy_alone(tiny_weights, [200, 201, 202], 6)
    assert restored.num_host_cached_tokens == 28


def test_aborting_a_loading_request_frees_its_pages(tiny_weights):
    copier = DeferredCopier()
    eng = engine(tiny_weights, host_pages=64, copier=copier)
    a = list(range(3, 31))
    eng.add_request("a", a, greedy(2))
    run_all(eng)
    flood(eng)
    copier.run()
    r = eng.add_request("a2", a + [9], greedy(3))
    eng.step()
    assert r.status is Status.LOADING
    assert eng.abort("a2") and eng.stats().pages_in_use == 0 and eng.stats().restoring == 0
    flood(eng, first=120)  # the restored pages get reused: their pending copy is fenced first
    copier.run()
    eng.add_request("a3", a + [9], greedy(3))
    assert tokens(run_copying(eng, copier)["a3"]) == greedy_alone(tiny_weights, a + [9], 3)


@pytest.mark.parametrize("policy,hit", [("session", 28), ("lru", 0)])
def test_session_pages_outlive_other_traffic_under_the_session_policy_only(tiny_weights, policy, hit):
    eng = engine(tiny_weights, num_pages=20, kv_eviction=policy)
    a = list(range(3, 31))
    eng.add_request("t1", a, greedy(4), session_id="agent")
    first = tokens(run_all(eng)["t1"])
    assert eng.stats().sessions_live == 1
    for i in range(6):  # other traffic: ordinary pages keep coming and going
        eng.add_request(f"x{i}", [90 + i] * 3 + list(range(60, 85)), greedy(2))
        run_all(eng)
    turn2 = a + first + [5, 6, 7]
    r = eng.add_request("t2", turn2, greedy(4), session_id="agent")
    assert tokens(run_all(eng)["t2"]) == greedy_alone(tiny_weights, turn2, 4)
    assert r.num_cached_tokens == hit


def test_close_and_ttl_expiry_release_every_pin(tiny_weights):
    eng = engine(tiny_weights, num_pages=20, session_ttl_s=1000.0)
    for sid in ("a", "b"):
        eng.add_request(f"{sid}1", [ord(sid)] * 20, greedy(3), session_id=sid)
    run_all(eng)
    assert eng.stats().sessions_live == 2 and eng.retention.num_pinned > 0
    assert eng.close_session("a") and not eng.close_session("a") and not eng.close_session("nope")
    eng.add_request("a2", [ord("a")] * 20, greedy(1), session_id="a")  # recently closed: no retention
    run_all(eng)
    assert eng.stats().sessions_live == 1
    eng.sessions.expire(time.monotonic() + 1001.0)
    assert eng.stats().sessions_live == 0 and eng.retention.num_pinned == 0
    assert eng.allocator.num_available == eng.allocator.num_pages
    eng.allocator.allocate(eng.allocator.num_pages)


def test_close_session_flag_closes_after_the_request(tiny_weights):
    eng = engine(tiny_weights)
    eng.add_request("t1", [5] * 12, greedy(2), session_id="s")
    run_all(eng)
    eng.add_request("t2", [5] * 14, greedy(2), session_id="s", close_session=True)
    assert eng.sessions.is_live("s")
    run_all(eng)
    assert not eng.sessions.is_live("s") and eng.retention.num_pinned == 0


def test_bad_session_ids_and_configs(tiny_weights):
    eng = engine(tiny_weights)
    for bad in ("", "x" * 257, 5):
        with pytest.raises(RequestError) as e:
            eng.add_request("r", [5, 6], greedy(1), session_id=bad)
        assert e.value.param == "session_id"
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(host_kv_bytes=1 << 20, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="kv_eviction"):
        EngineConfig(kv_eviction="fifo")


def test_pages_computed_after_a_prefix_hit_are_cached_too(tiny_weights):
    """A request admitted with a hit registers its own new full pages (the next turn finds its whole context)."""
    eng = engine(tiny_weights, num_pages=64)
    t1 = list(range(3, 23))  # 5 pages
    eng.add_request("t1", t1, greedy(2))
    out1 = tokens(run_all(eng)["t1"])
    t2 = t1 + out1 + list(range(100, 118))  # hits t1's 5 pages, computes 5 more full pages
    r2 = eng.add_request("t2", t2, greedy(2))
    out2 = tokens(run_all(eng)["t2"])
    assert r2.num_cached_tokens == 20
    t3 = t2 + out2 + [7, 7, 7]
    r3 = eng.add_request("t3", t3, greedy(2))
    run_all(eng)
    assert r3.num_cached_tokens == 40  # t2's full pages, not only t1's


def test_a_request_whose_host_prefix_does_not_fit_yet_waits_instead_of_recomputing(tiny_weights):
    eng = engine(tiny_weights, host_pages=64)
    a = list(range(3, 31))  # 7 pages
    eng.add_request("a", a, greedy(2))
    run_all(eng)
    flood(eng)
    b = eng.add_request("b", [200] * 30, greedy(22))  # holds up to 13 of the 16 pages while it decodes
    for _ in range(3):
        eng.step()
    r = eng.add_request("a2", a + [9], greedy(3))
    eng.step()
    assert r.status is Status.WAITING and b.status is Status.RUNNING  # 7 restores do not fit beside b yet
    out = tokens(run_all(eng)["a2"])
    assert r.num_host_cached_tokens == 28 and out == greedy_alone(tiny_weights, a + [9], 3)
