"""Hostile input against the real server: no 5xx for anything a client can send, and no client can stall the
others. Each class - extreme but valid sampling values, text that is not valid Unicode, pathological JSON, uploads
cut short, very large requests beside a running stream - asserts the 4xx OpenAI error body (or a correct answer)
and that the server keeps serving."""
import json
import logging
import re
import socket
import statistics
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

URL_C = "/v1/completions"
URL_CHAT = "/v1/chat/completions"


def post_raw(base_url, path, data: bytes, timeout=120):
    return httpx.post(base_url + path, content=data, headers={"content-type": "application/json"}, timeout=timeout)


def post(base_url, path, body, timeout=120):
    """JSON with ASCII escapes: lone surrogates travel as \\udXXX escapes, as a JSON encoder writes them."""
    return post_raw(base_url, path, json.dumps(body, ensure_ascii=True).encode(), timeout)


def assert_error(r, status, param=None, code=None, match=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    if match:
        assert re.search(match, err["message"]), err["message"]


def counter(base_url, name, **labels):
    """The value of counter ``name`` on the series that has ``labels`` (among others), 0 if none."""
    text = httpx.get(base_url + "/metrics").text
    for m in re.finditer(rf"^{name}_total\{{(.*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


@pytest.fixture(scope="module")
def greedy_text(base_url, model_name):
    r = post(base_url, URL_C, {"model": model_name, "prompt": "The capital of France is", "max_tokens": 4,
                               "temperature": 0})
    return r.json()["choices"][0]["text"]


# --- extreme but valid sampling values ---------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    {"temperature": 1e-30}, {"temperature": 1e-300}, {"temperature": 5e-324},  # the limit is greedy
    {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 1.0, "top_p": 5e-324},  # only the top token stays
    {"temperature": 1e-300, "top_p": 1e-300, "top_k": 2**63, "seed": 2**63},
])
def test_vanishing_temperature_or_top_p_is_greedy(base_url, model_name, greedy_text, params):
    r = post(base_url, URL_C, {"model": model_name, "prompt": "The capital of France is", "max_tokens": 4, **params})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text


@pytest.mark.parametrize("params", [
    {"temperature": 1e30}, {"temperature": 1.7e308}, {"top_k": 2**63}, {"top_k": 10**30},
    {"seed": 2**63}, {"seed": 2**64 - 1, "n": 2}, {"seed": -(2**63) - 1}, {"seed": 10**300},
])
def test_extreme_valid_values_are_served(base_url, model_name, params):
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True, **params}
    r = post(base_url, URL_C, body)
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    with httpx.stream("POST", base_url + URL_C, json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"


@pytest.mark.parametrize("raw, param, match", [
    ('"max_tokens": 9223372036854775808', "max_tokens", "exceeds"),
    ('"max_tokens": 1' + "0" * 1000, "max_tokens", "exceeds"),
    ('"max_tokens": -1' + "0" * 30, "max_tokens", "at least 1"),
    ('"n": 1' + "0" * 30, "n", "between 1 and"),
    ('"temperature": 1e999', "temperature", "finite"),
    ('"temperature": NaN', "temperature", "finite"),
    ('"top_p": -Infinity', "top_p", "top_p"),
    ('"stop_token_ids": [18446744073709551616]', "stop_token_ids", r"\[0, \d+\)"),
])
def test_out_of_range_values_are_400_naming_the_field(base_url, model_name, raw, param, match):
    r = post_raw(base_url, URL_C, f'{{"model": "{model_name}", "prompt": "hi", {raw}}}'.encode())
    assert_error(r, 400, param, "context_length_exceeded" if match == "exceeds" else None, match)


def test_prompt_token_ids_out_of_range_are_400(base_url, model_name):
    for ids in ([10**30], [-1], [1, 2**64]):
        assert_error(post(base_url, URL_C, {"model": model_name, "prompt": ids}), 400, "prompt", None, "token ids")


# --- text that is not valid Unicode ------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    (URL_C, {"prompt": "a\ud800b"}, "prompt"),
    (URL_C, {"prompt": ["ok", "x\udfff"]}, "prompt"),
    (URL_C, {"prompt": "hi", "stop": ["\udc00"]}, "stop"),
    (URL_C, {"prompt": "hi", "user": "\ud83d"}, "user"),
    (URL_CHAT, {"messages": [{"role": "user", "content": "x\udc00"}]}, "messages"),
    (URL_CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages"),
    (URL_C, {"prompt": "hi", "\ud800": 1}, "body key"),
])
def test_lone_surrogates_are_400_naming_the_field(base_url, model_name, path, body, param):
    r = post(base_url, path, {"model": model_name, **body})
    assert_error(r, 400, param, None, "not valid Unicode")


def test_lone_surrogate_model_name_is_400(base_url):
    assert_error(post(base_url, URL_C, {"model": "\ud800", "prompt": "hi"}), 400, "model", None, "U\\+D800")


def test_valid_unicode_is_served(base_url, model_name):
    # an escaped surrogate pair (an emoji), an escaped backslash before "ud800", NUL and the last code points
    for prompt in ["\U0001F600 smile", "\\ud800 is text here", "a\u0000b\uffff\U0010ffff"]:
        r = post(base_url, URL_C, {"model": model_name, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
    r = post_raw(base_url, URL_C, f'{{"model": "{model_name}", "prompt": "\xe9t\xe9", "max_tokens": 2}}'.encode(
        "latin-1"))  # not UTF-8 at all
    assert_error(r, 400, None, None, "not valid JSON")


# --- pathological JSON -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, raw", [
    ("deep arrays", "[" * 100_000 + "]" * 100_000),
    ("just too deep", "[" * 65 + "]" * 65),
    ("deep objects", '{"a":' * 500 + "1" + "}" * 500),
    ("a 5000-digit number", "9" * 5000),
    ("a 5000-digit float", "1" + "0" * 5000 + ".5"),
])
def test_pathological_json_is_400(base_url, model_name, name, raw):
    for path, extra in ((URL_C, '"prompt": "hi"'), (URL_CHAT, '"messages": [{"role": "user", "content": "x"}]')):
        r = post_raw(base_url, path, f'{{"model": "{model_name}", {extra}, "stop": {raw}}}'.encode())
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_nesting_up_to_the_limit_is_decoded():
    from mimw.server.body import MAX_DEPTH, decode_json

    ok = '{"a":' * (MAX_DEPTH - 1) + "[1]" + "}" * (MAX_DEPTH - 1)
    assert decode_json(ok.encode())["a"]["a"]
    with pytest.raises(Exception, match="deeper than"):
        decode_json(("[" + ok + "]").encode())


@pytest.mark.parametrize("items", ['1', '"a"', '{"role": "user", "content": "a"}'])
def test_huge_arrays_are_413_before_decoding(base_url, model_name, items):
    field = "messages" if "role" in items else "prompt"
    path = URL_CHAT if field == "messages" else URL_C
    raw = f'{{"model": "{model_name}", "{field}": [{",".join([items] * 1_000_000)}]}}'.encode()
    r = post_raw(base_url, path, raw)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_body_over_the_byte_limit_is_413_from_content_length(built, base_url, model_name):
    limit = built.app.state.server.cfg.max_body_bytes
    with socket.create_connection((urlparse(base_url).hostname, urlparse(base_url).port), timeout=30) as s:
        s.sendall(f"POST {URL_C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {limit + 1}\r\n\r\n".encode())  # no body: refused on the header alone
        reply = b""
        while b"body_too_large" not in reply:
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413")


# --- uploads cut short ---------------------------------------------------------------------------------------
@pytest.fixture
def server_log_records():
    """WARNING+ records of the server's loggers (uvicorn's do not propagate to the root logger)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Keep(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("mimw.server", "uvicorn.error", "uvicorn", "mimw.engine")]
    for lg in loggers:
        lg.addHandler(h)
    yield records
    for lg in loggers:
        lg.removeHandler(h)


def test_client_aborting_an_upload_is_a_client_fault(base_url, model_name, server_log_records):
    before_499 = counter(base_url, "mimw_requests", endpoint="completions", status="499")
    before_500 = counter(base_url, "mimw_requests", endpoint="completions", status="500")
    body = json.dumps({"model": model_name, "prompt": "x" * 5000}).encode()
    u = urlparse(base_url)
    for _ in range(3):
        with socket.create_connection((u.hostname, u.port), timeout=30) as s:
            s.sendall(f"POST {URL_C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:1000])
            time.sleep(0.2)  # the server is now waiting for the rest
        # closing the socket ends the upload mid-body
    deadline = time.monotonic() + 10
    while counter(base_url, "mimw_requests", endpoint="completions", status="499") < before_499 + 3:
        assert time.monotonic() < deadline, "the aborted uploads were not counted as 499"
        time.sleep(0.05)
    assert counter(base_url, "mimw_requests", endpoint="completions", status="500") == before_500
    assert not [r for r in server_log_records if r.levelno >= logging.ERROR], \
        [r.getMessage() for r in server_log_records]
    r = post(base_url, URL_C, {"model": model_name, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


# --- very large requests beside a running stream ------------------------------------------------------------
def test_prompt_too_long_in_bytes_is_refused_before_tokenizing(built, base_url, model_name, monkeypatch):
    srv = built.app.state.server
    limit = srv.max_prompt_bytes
    assert limit is not None and limit < srv.cfg.max_body_bytes
    calls = []
    monkeypatch.setattr(srv.tok, "encode", lambda text: calls.append(len(text)) or [1])
    text = "word " * (limit // 5 + 1)
    r = post(base_url, URL_C, {"model": model_name, "prompt": text})
    assert_error(r, 400, "prompt", "context_length_exceeded", rf"{len(text)} bytes")
    r = post(base_url, URL_CHAT, {"model": model_name, "messages": [{"role": "user", "content": text}]})
    assert_error(r, 400, "messages", "context_length_exceeded", "bytes")
    assert calls == []


def test_byte_limit_never_refuses_a_prompt_that_fits(built):
    """The limit is a proven bound: the longest-in-bytes tokens of the vocabulary, repeated to fill the context,
    stay under it."""
    tok = built.app.state.server.tok
    context = built.loop.engine.max_model_len
    worst = tok.decode([tok.encode("\n" + " " * 200)[-1]])  # a long whitespace token
    text = worst * (context // 2)
    assert len(text.encode()) <= tok.prompt_byte_limit(context)
    assert len(tok.encode(text)) <= context


def _stream_gaps(base_url, model_name, out, started):
    body = {"model": model_name, "prompt": "Count: 1, 2, 3,", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + URL_C, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.monotonic())
                if len(out) == 5:
                    started.set()


def test_a_huge_request_does_not_stall_other_streams(built, base_url, model_name):
    """Tokenizing a long prompt (half the byte limit, about half a megabyte: a second or more of CPU) while another
    request streams: the stream keeps its pace, since tokenizing runs on a tokenizer copy of its own, off the event
    loop and off the engine thread's decoding. With one lock shared by both (the failure this guards against), the
    stream stops for the whole tokenization: one gap as long as the big request."""
    limit = built.app.state.server.max_prompt_bytes
    words = "".join(f"w{i} " for i in range(5000))
    text = (words * (limit // len(words) + 1))[:limit // 2]
    times, started = [], threading.Event()
    t = threading.Thread(target=_stream_gaps, args=(base_url, model_name, times, started))
    t.start()
    assert started.wait(60)
    t0 = time.monotonic()
    r = post(base_url, URL_C, {"model": model_name, "prompt": text})  # tokenized, then too many tokens
    t1 = time.monotonic()
    t.join(120)
    assert_error(r, 400, "prompt", "context_length_exceeded", "tokens")
    gap = statistics.median(b - a for a, b in zip(times, times[1:]))
    during = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    busy = t1 - t0
    print(f"big request {busy:.2f} s; stream: median gap {gap:.3f} s, {len(during)} gaps while the big request ran, "
          f"the longest {max(during, default=0):.3f} s")
    assert busy > 4 * gap, "the big request was too quick to test anything"
    assert max(during) < busy / 2, "one stall covered most of the big request"
    assert len(during) >= busy / gap / 4, "the stream slowed down to a crawl while the big request ran"


# --- a little fuzzing: any JSON a client sends gets an answer below 500 ------------------------------------
def _fuzz_bodies():
    """A valid body with up to four fields replaced: by plausible values (extreme numbers, odd text) mostly, by any
    JSON value sometimes."""
    from hypothesis import strategies as st

    text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()),
                   max_size=12)
    scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | text
    anything = st.recursive(scalar, lambda k: st.lists(k, max_size=4) | st.dictionaries(text, k, max_size=4),
                            max_leaves=12)
    num = st.floats(allow_nan=True) | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 1e-300, 5e-324, 1e308])
    ids = st.lists(st.integers(-5, 2**64), max_size=4)
    plausible = {
        "prompt": text | st.lists(text, max_size=3) | ids | st.lists(ids, max_size=2),
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "bogus"]),
            "content": text | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                                   max_size=2)}), max_size=3),
        "temperature": num, "top_p": num, "top_k": num, "seed": num, "n": st.integers(-2, 20),
        "max_tokens": st.integers(-2, 3) | st.just(2**63), "stop": text | st.lists(text, max_size=3),
        "stop_token_ids": ids, "stream": st.booleans(), "ignore_eos": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "presence_penalty": num, "frequency_penalty": num, "logprobs": st.booleans() | st.integers(-1, 30),
        "user": text, "echo": st.booleans(), "model": text}
    fields = st.sampled_from(sorted(plausible)).flatmap(lambda f: st.tuples(st.just(f), plausible[f] | anything))
    return st.lists(fields, max_size=4)


def _fuzz_body(model_name, chat, changes):
    body = {"model": model_name, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    body.update(dict(changes))
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 3:  # keep generations short
        body["max_tokens"] = 2
    return body


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_5xx(base_url, model_name):
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(changes=_fuzz_bodies(), chat=st_booleans())
    def check(changes, chat):
        body = _fuzz_body(model_name, chat, changes)
        try:
            data = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
        except (TypeError, ValueError):
            return
        r = post_raw(base_url, URL_CHAT if chat else URL_C, data)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()


def st_booleans():
    from hypothesis import strategies as st

    return st.booleans()
