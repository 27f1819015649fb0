import pytest

from mimw.engine.sessions import SessionTable
from mimw.kv.prefix import ROOT, page_hash
from mimw.kv.retention import Retention

H = [page_hash(ROOT, [i]) for i in range(6)]


def table(ttl=10.0, max_sessions=8):
    r = Retention("session")
    return r, SessionTable(r, ttl, max_sessions)


def test_a_finished_turn_pins_its_pages_and_the_next_turn_replaces_them():
    r, t = table()
    assert t.begin("s", 0.0) and t.num_live == 1
    t.end("s", (H[0], H[1]), 1.0)
    assert r.is_pinned(H[0]) and r.is_pinned(H[1]) and t.retained("s") == (H[0], H[1])
    assert t.begin("s", 2.0)
    t.end("s", (H[0], H[1], H[2]), 3.0)
    assert r.num_pinned == 3
    t.begin("s", 4.0)
    t.end("s", None, 5.0)  # an aborted turn keeps what the session retained
    assert r.num_pinned == 3


def test_ttl_expiry_releases_every_pin_but_not_while_a_request_runs():
    r, t = table(ttl=10.0)
    t.begin("a", 0.0)
    t.end("a", (H[0], H[1]), 1.0)
    t.begin("b", 0.0)  # in flight for longer than the TTL
    t.begin("c", 5.0)
    t.end("c", (H[1], H[2]), 6.0)
    assert t.expire(11.0) == [] and r.num_pinned == 3
    assert t.expire(11.5) == ["a"] and r.is_pinned(H[1]) and not r.is_pinned(H[0])
    assert t.expire(100.0) == ["c"] and r.num_pinned == 0 and t.is_live("b")
    t.end("b", (H[3],), 100.0)
    assert t.expire(200.0) == ["b"] and r.num_pinned == 0 and t.num_live == 0
    assert t.begin("a", 300.0)  # an expired id is simply new again


def test_close_releases_pins_and_a_recently_closed_id_runs_without_retention():
    r, t = table(ttl=10.0)
    t.begin("s", 0.0)
    t.end("s", (H[0],), 1.0)
    assert t.close("s", 2.0) and r.num_pinned == 0 and not t.is_live("s")
    assert not t.close("s", 2.0) and not t.close("never-seen", 2.0)
    assert not t.begin("s", 3.0) and t.num_live == 0  # closed: not reopened
    assert t.begin("s", 13.0)  # forgotten after the TTL: a new session


def test_close_while_a_request_runs_and_its_end_afterwards():
    r, t = table()
    t.begin("s", 0.0)
    t.close("s", 1.0)
    t.end("s", (H[0],), 2.0)  # the request finishes after the close: nothing pinned
    assert r.num_pinned == 0 and t.num_live == 0


def test_a_full_table_closes_its_least_recently_used_idle_session():
    r, t = table(max_sessions=2)
    for i, sid in enumerate("ab"):
        t.begin(sid, float(i))
        t.end(sid, (H[i],), float(i))
    t.begin("a", 2.0)  # a is in flight, b is the LRU idle one
    assert t.begin("c", 3.0) and not t.is_live("b") and t.is_live("a") and t.num_live == 2
    assert not r.is_pinned(H[1])
    assert t.begin("b", 4.0) is True  # pushed out, not closed by its client: it may come back


def test_bad_config():
    with pytest.raises(ValueError):
        SessionTable(Retention(), ttl_s=-1)
    with pytest.raises(ValueError):
        SessionTable(Retention(), max_sessions=0)
