"""Serving behaviour of the real server: concurrent streams, client disconnects, prefix reuse, back-pressure
(429 past a bounded queue) and the optional API key."""
import asyncio
import re
import threading
import time

import httpx
import openai
import pytest
from server_helpers import serve_app

from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.loop import EngineLoop
from mimw.server.app import ServerConfig, create_app

QUESTIONS = ["What is 2+2?", "Name a fruit.", "Say hello in French.", "What colour is the sky?"]


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)  # every series has a model_name label
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_idle(base_url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(base_url, "mimw_kv_pages_in_use") or metric(base_url, "mimw_num_requests_running") \
            or metric(base_url, "mimw_num_requests_waiting"):
        assert time.monotonic() < deadline, "requests (and their KV pages) were not released"
        time.sleep(0.1)


def chat_kw(model, q, n=6):
    return dict(model=model, messages=[{"role": "user", "content": q}], max_tokens=n, temperature=0)


def test_32_concurrent_streams_match_the_same_requests_alone(base_url, model_name):
    sync = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    alone = [sync.chat.completions.create(**chat_kw(model_name, q)).choices[0].message.content for q in QUESTIONS]

    async def one(client, q):
        stream = await client.chat.completions.create(**chat_kw(model_name, q), stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        async with client:
            return await asyncio.gather(*(one(client, QUESTIONS[i % 4]) for i in range(32)))

    lat, stop = [], threading.Event()

    def probe():  # the HTTP layer stays responsive while the engine thread computes
        while not stop.is_set():
            t0 = time.perf_counter()
            httpx.get(base_url + "/health")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)

    t = threading.Thread(target=probe)
    t.start()
    try:
        outs = asyncio.run(main())
    finally:
        stop.set()
        t.join()
    assert outs == [alone[i % 4] for i in range(32)]
    lat.sort()
    print(f"/health latency under load: median {lat[len(lat) // 2]:.3f}s, max {lat[-1]:.3f}s, n={len(lat)}")
    assert lat[len(lat) // 2] < 0.5
    wait_idle(base_url)


def test_client_disconnect_mid_stream_frees_pages(base_url, model_name):
    wait_idle(base_url)
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines == 3:
                # still connected (leaving this loop closes the connection): the request holds KV pages
                deadline = time.monotonic() + 10  # engine stats are a snapshot taken after each step
                while metric(base_url, "mimw_kv_pages_in_use") == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                break
    # the response is closed mid-stream: the server notices on its next write and aborts the request
    wait_idle(base_url, timeout=30)
    assert re.search(r'^mimw_request_success_total{[^}]*finished_reason="abort"[^}]*} [1-9]',
                     httpx.get(base_url + "/metrics").text, re.M)


def test_non_streaming_client_timeout_aborts_the_request(base_url, model_name):
    wait_idle(base_url)
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=1.5)
    wait_idle(base_url, timeout=30)


def test_shared_prefix_is_reused_and_reaches_first_token_sooner(base_url, model_name):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    system = "You are a meticulous assistant. " + " ".join(f"Rule {i}: answer briefly and precisely." for i in
                                                            range(40))

    def ttft(question):
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model_name, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True})
        first = None
        for ch in stream:
            if first is None and ch.choices and ch.choices[0].delta.content:
                first = time.perf_counter() - t0
            usage = ch.usage
        return first, usage

    cold, u1 = ttft("Where is Rome?")
    warm, u2 = ttft("Where is Oslo?")
    assert u1.prompt_tokens > 300
    assert u1.prompt_tokens_details.cached_tokens < 32  # at most the default system preamble of earlier tests
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens - 32  # everything but the new question
    assert warm < cold, (warm, cold)
    assert metric(base_url, "mimw_prefix_cache_hit_rate") > 0


def test_bounded_queue_answers_429(built, model_name):
    # A second engine over the same weights: one batch slot and a queue of one
    eng = Engine(built.loop.engine.backend, built.loop.engine.tokenizer,
                 EngineConfig(num_pages=64, page_size=16, max_batch=1, max_step_tokens=64))
    loop = EngineLoop(eng, max_queue=1).start()
    app = create_app(loop, built.app.state.server.tok, ServerConfig(model_name=model_name))
    body = {"model": model_name, "prompt": "Count: 1, 2, 3,", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with serve_app(app) as url:
            results = []

            def hold():  # a streaming request that keeps the only slot busy
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    results.append(r.status_code)
                    for i, _ in enumerate(r.iter_lines()):
                        if i > 40:
                            break

            threads = [threading.Thread(target=hold) for _ in range(2)]
            threads[0].start()
            deadline = time.monotonic() + 30
            while metric(url, "mimw_num_requests_running") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            threads[1].start()  # waits in the queue
            while metric(url, "mimw_num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=model_name, prompt="hi", max_tokens=2)
            assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
            assert e.value.response.headers["retry-after"] == "1"
            for t in threads:
                t.join(60)
            assert results == [200, 200]
    finally:
        loop.stop()


def test_tiny_kv_pool_preempts_instead_of_failing(built, model_name):
    # 8 pages of 16 tokens; each chat needs 3 pages for its prompt and grows to 5: two running requests outgrow
    # the pool, so the newer one is preempted (and later recomputed, mostly from the prefix cache)
    eng = Engine(built.loop.engine.backend, built.loop.engine.tokenizer,
                 EngineConfig(num_pages=8, page_size=16, max_batch=4, max_step_tokens=256),
                 built.loop.engine.eos_token_ids)
    loop = EngineLoop(eng).start()
    app = create_app(loop, built.app.state.server.tok, ServerConfig(model_name=model_name))
    kw = [dict(chat_kw(model_name, q, 28), extra_body={"ignore_eos": True}) for q in QUESTIONS[:2]]
    try:
        with serve_app(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            alone = [client.chat.completions.create(**k).choices[0].message.content for k in kw]
            assert metric(url, "mimw_num_preemptions_total") == 0

            async def main():
                c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
                async with c:
                    rs = await asyncio.gather(*(c.chat.completions.create(**kw[i % 2]) for i in range(4)))
                return [r.choices[0].message.content for r in rs]

            assert asyncio.run(main()) == [alone[i % 2] for i in range(4)]
            assert metric(url, "mimw_num_preemptions_total") > 0
            wait_idle(url)
    finally:
        loop.stop()


def test_api_key_is_required_when_set(built, model_name):
    app = create_app(built.loop, built.app.state.server.tok, ServerConfig(model_name=model_name, api_key="s3cret"))
    with serve_app(app) as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert httpx.post(url + "/v1/completions", json={}).status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        r = good.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open


def test_body_limit_and_dead_engine(built, model_name):
    tok = built.app.state.server.tok
    small = create_app(built.loop, tok, ServerConfig(model_name=model_name, max_body_bytes=1000))
    with serve_app(small) as url:
        r = httpx.post(url + "/v1/completions", json={"model": model_name, "prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["message"]
    stopped = EngineLoop(built.loop.engine)  # never started: the engine is not running
    with serve_app(create_app(stopped, tok, ServerConfig(model_name=model_name))) as url:
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
