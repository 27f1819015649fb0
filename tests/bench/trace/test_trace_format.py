"""Trace model, readers, token synthesis and the synthetic agent-trace generator (no model needed)."""
import json
from pathlib import Path

import pytest

from mimw.bench.trace.format import Trace, TraceRequest
from mimw.bench.trace.readers import Timing, TraceFormatError, agent_trace, read_trace, write_jsonl
from mimw.bench.trace.synth import AgentTraceConfig, generate
from mimw.bench.trace.tokens import TokenSynth

TRACES = Path(__file__).resolve().parents[3] / "bench" / "traces"


def req(i, n_in, ids, bs=4, after=(), scope="", session=None):
    return TraceRequest(i, session, n_in, 2, tuple(ids), bs, scope, tuple(after), 0.0)


def test_ideal_hits_follow_the_longest_seen_prefix_and_partial_blocks():
    t = Trace("t", (req(0, 10, [1, 2, 3]),  # block 3 holds only 2 tokens
                    req(1, 12, [1, 2, 3]),  # block 3 now full: only its 2 seen tokens hit, then the prefix breaks
                    req(2, 9, [1, 9, 2]),  # the chain breaks at block 9
                    req(3, 8, [1, 2]),  # everything seen: all but the last token
                    req(4, 8, [1, 2], scope="other")))  # another conversation's local ids share nothing
    assert t.ideal_hit_tokens() == [0, 10, 4, 7, 0]
    assert t.working_set_tokens() == 4 + 4 + 4 + 4 + 8  # blocks 1, 2, 3 (at 4), 9, and scope "other"'s two


def test_requests_validate_their_fields():
    with pytest.raises(ValueError, match="earlier"):
        req(1, 4, [1], after=[1])
    with pytest.raises(ValueError, match="positive"):
        TraceRequest(0, None, 0, 1, (), 4)
    with pytest.raises(ValueError, match="index"):
        Trace("t", (req(1, 4, [1]),))


def test_mooncake_rows_sessionless_and_multi_turn():
    t = read_trace(TRACES / "mooncake-tiny.jsonl", Timing(time_scale=2.0))
    r = t.requests
    assert [x.block_size for x in r] == [512] * 6 and all(x.scope == "" for x in r)
    assert [x.after for x in r[:4]] == [()] * 4 and [x.delay_s for x in r[:4]] == [0.0, 0.1, 0.2, 0.3]
    assert r[4].session == "chat-1" and r[5].after == (4,) and r[5].delay_s == pytest.approx(0.06)  # delay: 30 ms
    assert t.ideal_hit_tokens()[3] == 329  # row 4 repeats row 2's first three blocks


def test_agent_conversations_chain_turns_and_sub_agents(tmp_path):
    conv = {"id": "c", "block_size": 8, "requests": [
        {"t": 0, "type": "s", "in": 20, "out": 2, "hash_ids": [1, 2, 3]},
        {"t": 5, "type": "s", "in": 30, "out": 2, "hash_ids": [1, 2, 4, 5], "think_time": 1.5},
        {"type": "subagent", "t": 6, "requests": [{"t": 6, "in": 20, "out": 1, "hash_ids": [1, 2, 7]},
                                                  {"t": 9, "in": 28, "out": 1, "hash_ids": [1, 2, 7, 8]}]},
        {"type": "subagent", "t": 6, "requests": [{"t": 7, "in": 18, "out": 1, "hash_ids": [1, 2, 9]}]},
        {"t": 20, "type": "s", "in": 40, "out": 2, "hash_ids": [1, 2, 4, 5, 6], "think_time": 0.5}]}
    t = agent_trace("x", [conv, {**conv, "id": "d"}], Timing(max_delay_s=2.0, stagger_s=10.0))
    r = t.requests
    assert [x.session for x in r[:5]] == ["c", "c", "c/sa1", "c/sa1", "c/sa2"]
    assert r[1].after == (0,) and r[1].delay_s == 1.5  # think_time, not the t gap
    assert r[2].after == (1,) and r[2].delay_s == 1.0 and r[3].after == (2,) and r[3].delay_s == 2.0  # capped
    assert r[4].after == (1,)  # sub-agents of one group start together
    assert r[5].after == (3, 4) and r[5].delay_s == 0.5  # the parent waits for both
    assert r[6].session == "d" and r[6].delay_s == 10.0 and r[6].after == ()  # staggered start
    assert r[0].scope == "c" and r[6].scope == "d"  # local ids by default
    assert t.last_of_session() == {3, 4, 5, 9, 10, 11}
    # the same records from a directory, a JSON list and JSON lines read the same
    (tmp_path / "dir").mkdir()
    for c in (conv, {**conv, "id": "d"}):
        (tmp_path / "dir" / f"{c['id']}.json").write_text(json.dumps(c))
    (tmp_path / "list.json").write_text(json.dumps([conv, {**conv, "id": "d"}]))
    write_jsonl(tmp_path / "lines.jsonl", [conv, {**conv, "id": "d"}])
    for p in ("dir", "list.json", "lines.jsonl"):
        assert read_trace(tmp_path / p, Timing(max_delay_s=2.0, stagger_s=10.0)).requests == t.requests


@pytest.mark.parametrize("content,match", [
    ("", "empty"), ("{not json\n", "not a JSON"), ('{"a": 1}\n', "neither"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}\n', "input_length"),
    ('{"id": "c", "requests": [{"t": 0, "in": 5, "out": 1, "hash_ids": [1, "2"]}]}\n', "hash_ids"),
    ('{"id": "c", "requests": [{"t": 0, "in": 0, "out": 1, "hash_ids": []}]}\n', "positive"),
])
def test_bad_trace_files_are_clear_errors(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(TraceFormatError, match=match):
        read_trace(p)
    with pytest.raises(TraceFormatError, match="no such"):
        read_trace(tmp_path / "missing.jsonl")


def test_tokens_equal_ids_equal_tokens_and_nothing_else_shared():
    s = TokenSynth(49152, seed=3)
    a = s.prompt(req(0, 10, [1, 2, 3]))
    b = s.prompt(req(1, 12, [1, 2, 4]))
    c = s.prompt(req(2, 10, [1, 2, 3], scope="other"))
    d = s.prompt(req(3, 14, [1, 2]))  # 6 tokens past its ids: private padding
    e = s.prompt(req(4, 14, [1, 2]))
    assert len(a) == 10 and len(b) == 12 and len(d) == 14
    assert a[:8] == b[:8] and a[8:] != b[8:10] and a[:4] != c[:4]
    assert d[:8] == a[:8] and d[8:] != e[8:]
    assert all(100 <= t < 32000 for t in a + b + c + d)
    assert TokenSynth(49152, seed=3).prompt(req(0, 10, [1, 2, 3])) == a  # deterministic
    assert TokenSynth(49152, seed=4).prompt(req(0, 10, [1, 2, 3])) != a
    assert all(3 <= t < 256 for t in TokenSynth(256).prompt(req(0, 10, [1, 2, 3])))


def test_synthetic_agent_trace_has_the_shape_of_agent_sessions():
    cfg = AgentTraceConfig(sessions=5, min_turns=4, max_turns=6, system_tokens=300, tool_tokens=500,
                           first_user_tokens=100, tool_output_tokens=60, output_tokens=20, subagent_prob=0.4,
                           max_context=3000, seed=7)
    convs = generate(cfg)
    assert convs == generate(cfg)  # deterministic
    t = agent_trace("synth", convs, Timing())
    by_session: dict[str, list] = {}
    for r in t.requests:
        by_session.setdefault(r.session, []).append(r)
    shared = 800 // 64  # full blocks of the system prompt and tools
    for sid, rs in by_session.items():
        for prev, cur in zip(rs, rs[1:]):
            assert cur.input_length > prev.input_length  # the context grows
            full = prev.input_length // 64
            assert cur.hash_ids[:full] == prev.hash_ids[:full]  # the previous turn's context is the prefix
            assert cur.after and cur.after[-1] >= prev.index
        assert rs[0].hash_ids[:shared] == t.requests[0].hash_ids[:shared]  # one agent: shared prefix
        assert max(r.input_length + r.output_length for r in rs) <= 3000
    subs = [sid for sid in by_session if "/sa" in sid]
    assert subs, "sub-agents were drawn"
    parent = by_session[subs[0].split("/")[0]]
    first_sub = by_session[subs[0]][0]
    forked = [p for p in parent if p.index in first_sub.after][0]
    assert first_sub.hash_ids[:forked.input_length // 64] == forked.hash_ids[:forked.input_length // 64]
    st = t.stats()
    assert 0.7 < st["ideal_hit_rate"] < 1.0 and st["working_set_tokens"] < st["prompt_tokens"]
    with pytest.raises(ValueError):
        AgentTraceConfig(max_turns=1, min_turns=2)
    with pytest.raises(ValueError):
        AgentTraceConfig(subagent_context="half")


def test_committed_test_traces_read():
    for name in ("agent-tiny.jsonl", "mooncake-tiny.jsonl"):
        st = read_trace(TRACES / name).stats()
        assert st["requests"] > 0 and 0 < st["ideal_hit_rate"] < 1
