"""Sessions and the host KV tier through the HTTP API, with the OpenAI client's extra_body / extra_headers."""
import argparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import serve_app

from mimw.server.main import add_arguments, build

PROMPT = "The agent reads the repository, runs the tests and reports back. " * 2  # 130 byte tokens


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def metric(url, name, **labels):
    text = httpx.get(url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


@pytest.fixture(scope="module")
def server():
    b = build(parse("--model", "tiny-llama", "--kv-pages", "24", "--page-size", "8", "--max-batch", "4",
                    "--device", "cpu", "--host-kv-gb", "0.002", "--session-ttl", "600"))
    try:
        with serve_app(b.app) as url:
            yield b, url
    finally:
        b.loop.stop()


def complete(client, prompt, **kw):
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)


def test_a_session_turn_reuses_the_previous_turns_pages(server):
    b, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first = complete(client, PROMPT, extra_body={"session_id": "agent-1"})
    assert metric(url, "mimw_num_sessions_live") == 1
    second = complete(client, PROMPT + first.choices[0].text + " next", extra_headers={"X-Session-ID": "agent-1"})
    assert second.usage.prompt_tokens_details.cached_tokens >= 128
    assert b.loop.engine.sessions.is_live("agent-1")


def test_evicted_session_pages_come_back_from_the_host_tier(server):
    b, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = "session two keeps a long context " * 5
    first = complete(client, prompt, extra_body={"session_id": "agent-2"})
    for i in range(3):  # other traffic that needs the whole device pool
        complete(client, f"{i} unrelated request that fills the device pool " * 4)
    before = metric(url, "mimw_prefix_cache_tier_hits", tier="host")
    second = complete(client, prompt + first.choices[0].text, extra_body={"session_id": "agent-2"})
    host_hits = metric(url, "mimw_prefix_cache_tier_hits", tier="host") - before
    assert host_hits > 0 and second.usage.prompt_tokens_details.cached_tokens >= host_hits
    assert metric(url, "mimw_kv_host_copied_bytes", direction="to_device") > 0
    assert metric(url, "mimw_kv_host_copied_bytes", direction="to_host") > 0
    assert metric(url, "mimw_kv_host_pages_used") > 0
    assert metric(url, "mimw_kv_host_pages_total") == b.loop.engine.host.num_pages


def test_close_by_endpoint_and_by_request_field(server):
    b, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    complete(client, "close me " * 3, extra_body={"session_id": "to-close"})
    r = httpx.delete(url + "/v1/sessions/to-close")
    assert r.status_code == 200 and r.json() == {"id": "to-close", "object": "session.deleted", "deleted": True}
    r = httpx.delete(url + "/v1/sessions/to-close")
    assert r.status_code == 200 and r.json()["deleted"] is False
    assert httpx.delete(url + "/v1/sessions/never-seen").json()["deleted"] is False
    # a recently closed session is not an error: the request runs, without retention
    out = complete(client, "close me " * 3, extra_body={"session_id": "to-close"})
    assert out.choices[0].finish_reason == "length" and not b.loop.engine.sessions.is_live("to-close")
    complete(client, "last turn " * 3, extra_body={"session_id": "by-field", "close_session": True})
    assert not b.loop.engine.sessions.is_live("by-field")


@pytest.mark.parametrize("body,headers", [
    ({"session_id": ""}, {}),
    ({"session_id": "x" * 257}, {}),
    ({"session_id": 7}, {}),
    ({"close_session": "yes"}, {}),
    ({"session_id": "a"}, {"X-Session-ID": "b"}),
    ({}, {"X-Session-ID": "y" * 300}),
])
def test_bad_session_fields_are_a_400_naming_the_field(server, body, headers):
    _, url = server
    r = httpx.post(url + "/v1/completions", headers=headers,
                   json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("session_id", "close_session")


def test_chat_endpoint_takes_the_field_too(server):
    _, url = server
    r = httpx.post(url + "/v1/chat/completions",
                   json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                         "session_id": "chat", "close_session": False})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]  # validated, then refused


def test_delete_needs_the_api_key_when_one_is_set():
    b = build(parse("--model", "tiny-llama", "--kv-pages", "8", "--page-size", "8", "--device", "cpu",
                    "--api-key", "k"))
    try:
        with serve_app(b.app) as url:
            assert httpx.delete(url + "/v1/sessions/s").status_code == 401
            r = httpx.delete(url + "/v1/sessions/s", headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["deleted"] is False
    finally:
        b.loop.stop()


@pytest.mark.parametrize("flag,value", [("--session-ttl", "-1"), ("--host-kv-gb", "nan"), ("--host-kv-gb", "x"),
                                        ("--kv-eviction", "fifo")])
def test_bad_session_and_tier_flags_are_rejected_by_the_parser(flag, value):
    with pytest.raises(SystemExit):
        parse(flag, value)
