"""The OpenAI API surface of the real server, driven with the official ``openai`` client (and raw httpx where
the client would refuse to send the bad input): responses, streaming, usage, and every kind of bad input -> 4xx
with an OpenAI error body, after which the server still serves."""
import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(base_url, client, model_name):
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name


def test_chat_completion_uses_the_chat_template(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert "Paris" in c.message.content and c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 20 and 0 < u.completion_tokens <= 12  # the template adds a system prompt
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_streaming_matches_non_streaming(client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=10,
              temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_plain_streamed_and_token_prompt(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    s = list(client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    ids = client.completions.create(model=model_name, prompt=[504, 3575, 282, 4649, 314], max_tokens=3,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_n_choices_and_multiple_prompts(client, model_name):
    r = client.completions.create(model=model_name, prompt=["Hello", "One, two,"], max_tokens=3, temperature=0,
                                  n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy copies agree
    assert r.usage.completion_tokens == 12


def test_stop_string_is_not_returned(client, model_name):
    base = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    text = base.choices[0].text
    stop = text.strip()[:2]
    assert stop
    r = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


def _bad(client, model_name, **kw):
    args = dict(model=model_name, messages=MSG, max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    return e.value


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(max_tokens=10**6), "max_tokens"),
    (dict(n=0), "n"),
    (dict(n=1000), "n"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "x " * 9000}]), "messages"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens="ten"), "max_tokens"),
    (dict(extra_body={"stop": [""]}), "stop"),
    (dict(extra_body={"stop_token_ids": [10**7]}), "stop_token_ids"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(logit_bias={"5": 150}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(logit_bias={"hello": 1}), "logit_bias"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                "function": {"name": "g"}}),
     "tool_choice"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "grammar"}), "response_format"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    # OpenAI parameters mimw does not implement: refused by name, never ignored
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (dict(modalities=["text", "audio"]), "modalities"),
    (dict(prediction={"type": "content", "content": "x"}), "prediction"),
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(function_call="auto"), "function_call"),
    (dict(web_search_options={}), "web_search_options"),
    (dict(service_tier="flex"), "service_tier"),
    (dict(store=True), "store"),
    (dict(metadata={"a": "b"}), "metadata"),
    (dict(reasoning_effort="low"), "reasoning_effort"),
    (dict(verbosity="low"), "verbosity"),
    (dict(prompt_cache_key="k"), "prompt_cache_key"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(messages=[{"role": "user", "content": "hi", "audio": {"id": "a"}}]), "messages"),
])
def test_bad_chat_input_is_a_400_naming_the_field(client, model_name, kw, param):
    e = _bad(client, model_name, **kw)
    assert e.status_code == 400
    err = e.body if "message" in e.body else e.body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_over_long_prompt_and_context_overflow_have_a_code(client, model_name):
    e = _bad(client, model_name, messages=[{"role": "user", "content": "x " * 9000}])
    assert e.code == "context_length_exceeded"
    e = _bad(client, model_name, max_tokens=8190)
    assert e.code == "context_length_exceeded" and "max_tokens" in e.message


def test_unknown_model_is_404(client):
    e = _bad(client, "gpt-17")
    assert e.status_code == 404 and e.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize("body", [
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt=[1, -4]),
    dict(prompt=[[1, 10**9]]),
    dict(prompt=5),
    dict(prompt="hi", max_tokens=0),
    dict(prompt="hi", stream="yes"),
    dict(prompt="hi", logprobs=6),
    dict(prompt="hi", logprobs=True),
    dict(prompt="hi", best_of=3),
    dict(prompt="hi", suffix="end"),
    dict(prompt="hi", top_logprobs=2),
    dict(prompt=["a"] * 17),
    dict(),
])
def test_bad_completion_input_is_a_400(base_url, model_name, body):
    r = httpx.post(base_url + "/v1/completions", json={"model": model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"null"])
def test_malformed_json_is_a_400(base_url, raw):
    r = httpx.post(base_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_wrong_method(base_url):
    r = httpx.get(base_url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(base_url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_serves_after_bad_input(base_url, client, model_name):
    assert httpx.get(base_url + "/health").status_code == 200
    r = client.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
